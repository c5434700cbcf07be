//! `deploy/kubernetes/`, checked as far as it can be without a cluster: every document parses and
//! has the fields Kubernetes requires of its kind, names refer to things the manifests define
//! (volumes, Secrets, Services, selectors), every rlaunch command line in them is accepted by the
//! real binaries (`rlaunch --print-config`, `rlaunch-rendezvous --check-config`), and every
//! rlaunch image is one `docker/build.sh` builds from the Dockerfile.

use std::collections::{BTreeMap, BTreeSet};
use std::process::Command;
use std::time::Duration;

use serde_json::Value;

use integration_tests::*;

fn manifests() -> BTreeMap<String, Vec<Value>> {
    let dir = repo_root().join("deploy/kubernetes");
    let mut out = BTreeMap::new();
    for e in std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
        let path = e.expect("a directory entry").path();
        if path.extension().and_then(|x| x.to_str()) != Some("yaml") {
            continue;
        }
        let text = std::fs::read_to_string(&path).expect("readable manifest");
        let mut docs = Vec::new();
        for doc in serde_yaml::Deserializer::from_str(&text) {
            let v: serde_yaml::Value = serde::Deserialize::deserialize(doc)
                .unwrap_or_else(|e| panic!("{} does not parse: {e}", path.display()));
            if v.is_null() {
                continue;
            }
            docs.push(serde_json::to_value(v).expect("YAML maps to JSON"));
        }
        out.insert(path.file_name().unwrap().to_string_lossy().into_owned(), docs);
    }
    assert!(out.len() >= 4, "etcd, rendezvous, a Job and a JobSet: {:?}", out.keys());
    out
}

fn str_at<'a>(v: &'a Value, path: &str) -> &'a str {
    v.pointer(path).and_then(Value::as_str).unwrap_or_else(|| panic!("{path} missing or not a string in {v}"))
}

/// A DNS-1123 label, as Kubernetes requires of most names.
fn dns_label(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
        && !s.starts_with('-')
        && !s.ends_with('-')
}

/// The pod templates of a workload: (where, the pod template).
fn pod_templates(doc: &Value) -> Vec<(String, &Value)> {
    let kind = str_at(doc, "/kind");
    let name = str_at(doc, "/metadata/name");
    match kind {
        "Deployment" | "StatefulSet" | "Job" => vec![(format!("{kind}/{name}"), &doc["spec"]["template"])],
        "JobSet" => doc["spec"]["replicatedJobs"]
            .as_array()
            .expect("a JobSet has replicatedJobs")
            .iter()
            .map(|rj| (format!("JobSet/{name}/{}", str_at(rj, "/name")), &rj["template"]["spec"]["template"]))
            .collect(),
        _ => Vec::new(),
    }
}

fn check_indexed_job(spec: &Value, at: &str) {
    assert_eq!(spec["completionMode"], "Indexed", "{at}: one pod per node, each with its index");
    assert_eq!(spec["completions"], spec["parallelism"], "{at}: every node's pod runs at once");
    assert_eq!(spec["backoffLimit"], 0, "{at}: rlaunch restarts workers; Kubernetes must not restart pods");
    let restart = str_at(spec, "/template/spec/restartPolicy");
    assert!(restart == "Never", "{at}: restartPolicy {restart}");
}

#[test]
fn manifests_parse_and_have_the_fields_kubernetes_requires() {
    let all = manifests();
    let docs: Vec<&Value> = all.values().flatten().collect();
    let secrets: BTreeSet<&str> =
        docs.iter().filter(|d| d["kind"] == "Secret").map(|d| str_at(d, "/metadata/name")).collect();
    let services: BTreeSet<&str> =
        docs.iter().filter(|d| d["kind"] == "Service").map(|d| str_at(d, "/metadata/name")).collect();
    let mut pod_labels: Vec<&serde_json::Map<String, Value>> = Vec::new();
    for doc in &docs {
        let (api, kind, name) = (str_at(doc, "/apiVersion"), str_at(doc, "/kind"), str_at(doc, "/metadata/name"));
        assert!(dns_label(name), "{kind} name {name:?}");
        let expected_api = match kind {
            "Service" | "Secret" => "v1",
            "Deployment" | "StatefulSet" => "apps/v1",
            "Job" => "batch/v1",
            "PodDisruptionBudget" => "policy/v1",
            "JobSet" => "jobset.x-k8s.io/v1alpha2",
            other => panic!("an unexpected kind {other}"),
        };
        assert_eq!(api, expected_api, "{kind}/{name}");
        match kind {
            "Service" => {
                let ports = doc["spec"]["ports"].as_array().expect("a Service has ports");
                assert!(!ports.is_empty() && ports.iter().all(|p| p["port"].is_u64()), "{name}: {ports:?}");
                assert!(doc["spec"]["selector"].is_object(), "{name}: a selector");
            }
            "Secret" => assert!(doc["stringData"].is_object() || doc["data"].is_object(), "{name}"),
            "Deployment" | "StatefulSet" => {
                let selector = doc["spec"]["selector"]["matchLabels"].as_object().expect("matchLabels");
                let labels = doc["spec"]["template"]["metadata"]["labels"].as_object().expect("pod labels");
                for (k, v) in selector {
                    assert_eq!(labels.get(k), Some(v), "{kind}/{name}: the selector matches its pods");
                }
                if kind == "StatefulSet" {
                    assert!(services.contains(str_at(doc, "/spec/serviceName")), "{name}: its headless Service");
                }
            }
            "Job" => check_indexed_job(&doc["spec"], &format!("Job/{name}")),
            "JobSet" => {
                for rj in doc["spec"]["replicatedJobs"].as_array().expect("replicatedJobs") {
                    check_indexed_job(&rj["template"]["spec"], &format!("JobSet/{name}"));
                }
            }
            "PodDisruptionBudget" => assert!(doc["spec"]["selector"]["matchLabels"].is_object(), "{name}"),
            _ => {}
        }
        for (at, pod) in pod_templates(doc) {
            if let Some(l) = pod["metadata"]["labels"].as_object() {
                pod_labels.push(l);
            }
            let spec = &pod["spec"];
            let mut volumes: BTreeMap<&str, &Value> = spec["volumes"]
                .as_array()
                .map(|v| v.iter().map(|v| (str_at(v, "/name"), v)).collect())
                .unwrap_or_default();
            // A StatefulSet's claims are volumes of its pods too.
            for claim in doc["spec"]["volumeClaimTemplates"].as_array().into_iter().flatten() {
                volumes.insert(str_at(claim, "/metadata/name"), claim);
            }
            for v in volumes.values() {
                if let Some(secret) = v["secret"]["secretName"].as_str() {
                    assert!(secrets.contains(secret), "{at}: Secret {secret} is defined in deploy/kubernetes");
                }
            }
            let containers = spec["containers"].as_array().expect("containers");
            assert!(!containers.is_empty(), "{at}");
            for c in containers {
                let cname = str_at(c, "/name");
                assert!(dns_label(cname), "{at}: container name {cname:?}");
                assert!(!str_at(c, "/image").is_empty(), "{at}/{cname}: an image");
                for m in c["volumeMounts"].as_array().into_iter().flatten() {
                    let v = str_at(m, "/name");
                    assert!(volumes.contains_key(v), "{at}/{cname}: mounts volume {v}, which the pod defines");
                    assert!(str_at(m, "/mountPath").starts_with('/'), "{at}/{cname}");
                }
                if str_at(c, "/image").starts_with("rlaunch-rendezvous:") {
                    for probe in ["readinessProbe", "livenessProbe"] {
                        assert_eq!(c[probe]["httpGet"]["path"], "/healthz", "{at}: {probe}");
                        assert_eq!(c[probe]["httpGet"]["port"], 29400, "{at}: {probe}");
                    }
                }
            }
        }
    }
    // Every Service selects some workload's pods.
    for doc in docs.iter().filter(|d| d["kind"] == "Service") {
        let sel = doc["spec"]["selector"].as_object().expect("selector");
        assert!(
            pod_labels.iter().any(|l| sel.iter().all(|(k, v)| l.get(k) == Some(v))),
            "Service {} selects no pods of the manifests",
            str_at(doc, "/metadata/name")
        );
    }
    let replicas = |kind: &str, name: &str| {
        docs.iter()
            .find(|d| d["kind"] == kind && d["metadata"]["name"] == name)
            .map(|d| d["spec"]["replicas"].clone())
            .unwrap_or_else(|| panic!("{kind}/{name} is missing"))
    };
    assert_eq!(replicas("StatefulSet", "etcd"), 3, "three etcd members");
    assert_eq!(replicas("Deployment", "rendezvous"), 2, "two rendezvous replicas");
}

/// The images `docker/build.sh` tags (each from the Dockerfile's targets).
fn built_images() -> BTreeSet<String> {
    let script = std::fs::read_to_string(repo_root().join("docker/build.sh")).expect("docker/build.sh");
    script.split("-t \"${prefix}").skip(1).filter_map(|rest| rest.split('"').next()).map(str::to_owned).collect()
}

#[test]
fn every_command_line_is_accepted_by_the_binaries_and_every_image_is_one_the_dockerfile_builds() {
    let images = built_images();
    assert_eq!(images, ["rlaunch", "rlaunch-rendezvous"].into_iter().map(str::to_owned).collect());
    let build = std::fs::read_to_string(repo_root().join("docker/build.sh")).unwrap();
    assert!(build.contains("stage docker/rootfs-launcher rlaunch examples/train"), "the launcher image has train");
    let dir = tempdir();
    let token = dir.path().join("token");
    std::fs::write(&token, "s3cret\n").unwrap();
    let mut checked = 0;
    for (file, docs) in manifests() {
        for doc in &docs {
            for (at, pod) in pod_templates(doc) {
                for c in pod["spec"]["containers"].as_array().into_iter().flatten() {
                    let image = str_at(c, "/image");
                    let Some(name) = image.split(':').next().filter(|n| n.starts_with("rlaunch")) else { continue };
                    assert!(images.contains(name), "{file} {at}: {image} is not an image docker/build.sh builds");
                    // The Secret is mounted at /var/run/secrets/rlaunch: here, the test's file.
                    let args: Vec<String> = c["args"]
                        .as_array()
                        .expect("args")
                        .iter()
                        .map(|a| {
                            a.as_str()
                                .expect("a string")
                                .replace("/var/run/secrets/rlaunch/token", token.to_str().unwrap())
                        })
                        .collect();
                    let (bin_name, check) = if name == "rlaunch" {
                        ("rlaunch", "--print-config")
                    } else {
                        ("rlaunch-rendezvous", "--check-config")
                    };
                    let mut cmd = Command::new(bin(bin_name));
                    // A pod of an Indexed Job: its index, and the host name Kubernetes gives it.
                    cmd.env("JOB_COMPLETION_INDEX", "1").env("HOSTNAME", "train-1").env_remove("PET_RDZV_ID");
                    // The check flag goes first: everything after the program is the program's.
                    let o = run_deadline(cmd.arg(check).args(&args), Duration::from_secs(30));
                    assert!(
                        o.status.success(),
                        "{file} {at}: `{bin_name} {}` refused: {}{}",
                        args.join(" "),
                        stdout_of(&o),
                        stderr_of(&o)
                    );
                    if name == "rlaunch" {
                        assert!(stdout_of(&o).contains("effective rdzv-id:      k8s-train"), "{}", stdout_of(&o));
                    }
                    checked += 1;
                }
            }
        }
    }
    assert!(checked >= 3, "the rendezvous, the Job and the JobSet: {checked}");
}
