//! `--device cuda|auto|cpu`: probe the CUDA libraries and the GPU this rank would use.

use rlaunch_kernels::probe::{self, Lib, Probe, SearchPath};

use super::GpuError;

/// What the user asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Device {
    Cpu,
    /// The GPU or an error saying what is missing.
    Cuda,
    /// The GPU when everything is there, else the CPU with a notice.
    Auto,
}

impl std::str::FromStr for Device {
    type Err = UnknownDevice;
    fn from_str(s: &str) -> Result<Self, UnknownDevice> {
        match s {
            "cpu" => Ok(Device::Cpu),
            "cuda" | "gpu" => Ok(Device::Cuda),
            "auto" => Ok(Device::Auto),
            other => Err(UnknownDevice(other.to_owned())),
        }
    }
}

/// A `--device` value that is no [`Device`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown device {0:?} (expected cuda, auto or cpu)")]
pub struct UnknownDevice(pub String);

/// What will be used.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Selected {
    /// The CPU; `notice` says why when `auto` fell back.
    Cpu { notice: Option<String> },
    /// GPU `ordinal` (= `LOCAL_RANK`), with the probe that found it.
    Cuda { ordinal: usize, probe: Probe },
}

/// Chooses the device for local rank `local_rank`. `need_nccl` when the job has more than one
/// rank (a single rank trains without NCCL).
pub fn select(device: Device, local_rank: usize, need_nccl: bool, search: &SearchPath) -> Result<Selected, GpuError> {
    if device == Device::Cpu {
        return Ok(Selected::Cpu { notice: None });
    }
    let name = if device == Device::Cuda { "cuda" } else { "auto" };
    let p = probe::probe(search);
    let mut libs = vec![Lib::Driver, Lib::Nvrtc, Lib::Cublas];
    if need_nccl {
        libs.push(Lib::Nccl);
    }
    let outcome =
        p.require(&libs, true).map_err(|source| GpuError::Unavailable { device: name, source }).and_then(|()| {
            let devices = p.devices.clone().unwrap_or(0);
            if local_rank < devices {
                Ok(local_rank)
            } else {
                Err(GpuError::NotEnoughGpus { local_rank, devices })
            }
        });
    match (device, outcome) {
        (_, Ok(ordinal)) => Ok(Selected::Cuda { ordinal, probe: p }),
        (Device::Auto, Err(e)) => {
            let why = match e {
                GpuError::Unavailable { source, .. } => source.to_string(),
                other => other.to_string(),
            };
            Ok(Selected::Cpu { notice: Some(format!("--device auto: training on the CPU; {why}")) })
        }
        (_, Err(e)) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_is_chosen_without_probing_and_auto_falls_back_with_a_notice_when_libraries_are_missing() {
        assert_eq!(select(Device::Cpu, 0, true, &SearchPath::system()).expect("cpu"), Selected::Cpu { notice: None });
        // No GPU machine runs this unit test suite with a driver absent *and* a GPU present,
        // so: either everything is there (a GPU machine) or auto falls back with a reason.
        match select(Device::Auto, 0, false, &SearchPath::system()).expect("auto never fails") {
            Selected::Cpu { notice } => {
                let n = notice.expect("a fallback says why");
                assert!(n.contains("--device auto") && n.contains("CPU"), "{n}");
            }
            Selected::Cuda { ordinal, .. } => assert_eq!(ordinal, 0),
        }
    }

    #[test]
    fn cuda_fails_with_the_probe_message_when_a_library_is_missing() {
        match select(Device::Cuda, 0, false, &SearchPath::system()) {
            Ok(Selected::Cuda { .. }) => {} // a GPU machine
            Ok(other) => panic!("--device cuda never falls back: {other:?}"),
            Err(e) => {
                let msg = e.to_string();
                assert!(msg.starts_with("--device cuda:"), "{msg}");
            }
        }
        assert_eq!("auto".parse::<Device>(), Ok(Device::Auto));
        assert!("tpu".parse::<Device>().is_err());
    }
}
