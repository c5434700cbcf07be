//! `rlaunch`: parses the command line into the agent's configuration, runs the agent, and maps
//! its outcome to the process exit code.

mod cli;
mod config_file;
mod slurm;
mod status;
mod token_file;

use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    if std::env::args_os().nth(1).is_some_and(|a| a == "status") {
        return status_main();
    }
    if std::env::args_os().nth(1).is_some_and(|a| a == "top") {
        return top_main();
    }
    let env = |k: &str| std::env::var(k).ok();
    let (args, sources) = match cli::parse(std::env::args_os().collect(), &env) {
        Ok(parsed) => parsed,
        // clap prints help/version to stdout with code 0 and usage errors with code 2.
        Err(cli::ParseError::Clap(e)) => e.exit(),
        Err(cli::ParseError::Usage(e)) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    if let Some(shell) = args.print_completion {
        cli::print_completion(shell);
        return ExitCode::SUCCESS;
    }
    if args.print_config {
        print!("{}", cli::render_config(&args, &sources, &env));
        // With a program, what would run is checked too: an error here is the error a run gets.
        if !args.program.is_empty() {
            let (python, _) = cli::python_interpreter(&env, std::env::current_exe().ok());
            if let Err(e) = args.into_config(&python, &env) {
                eprintln!("error: {e}");
                return ExitCode::from(2);
            }
        }
        return ExitCode::SUCCESS;
    }
    init_tracing();
    let (python, why) = cli::python_interpreter(&env, std::env::current_exe().ok());
    let config = match args.into_config(&python, &env) {
        Ok(c) => {
            if c.program.first() == Some(&python) {
                tracing::info!(python = %python.to_string_lossy(), from = %why, "python interpreter");
            }
            c
        }
        Err(e) => {
            eprintln!("error: {e}\n\nFor more information, try '--help'.");
            return ExitCode::from(2);
        }
    };
    let runtime = match tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("rlaunch: cannot start the async runtime: {e}");
            return ExitCode::from(1);
        }
    };
    let code = match runtime.block_on(rlaunch_agent::run(config)) {
        Ok(outcome) => outcome.exit_code(),
        Err(e) => {
            let code = agent_error_code(&e);
            // The chain may quote what the rendezvous or another node sent.
            let chain = anyhow::Error::from(e).chain().map(|c| c.to_string()).collect::<Vec<_>>().join(": ");
            eprintln!("rlaunch: {}", rlaunch::terminal::sanitize(&chain));
            code
        }
    };
    // Workers are already stopped; don't wait for lingering runtime tasks.
    runtime.shutdown_timeout(std::time::Duration::from_millis(100));
    ExitCode::from(u8::try_from(code.clamp(0, 255)).expect("clamped to a byte"))
}

/// A subcommand's async work on a runtime of its own; its error printed as `rlaunch NAME: …`.
fn run_async<T, E: std::fmt::Display>(
    name: &str,
    work: impl std::future::Future<Output = Result<T, E>>,
) -> Result<T, ExitCode> {
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().map_err(|e| {
        eprintln!("rlaunch {name}: cannot start the async runtime: {e}");
        ExitCode::from(1)
    })?;
    runtime.block_on(work).map_err(|e| {
        eprintln!("rlaunch {name}: {e}");
        ExitCode::from(1)
    })
}

fn status_main() -> ExitCode {
    let args = status::StatusArgs::parse_from(std::env::args_os().skip(1));
    match run_async("status", status::run(args)) {
        Ok(text) => {
            println!("{}", text.trim_end());
            ExitCode::SUCCESS
        }
        Err(code) => code,
    }
}

fn top_main() -> ExitCode {
    use std::io::IsTerminal;
    let args = status::TopArgs::parse_from(std::env::args_os().skip(1));
    let terminal = std::io::stdout().is_terminal();
    let mut out = std::io::stdout();
    match run_async("top", status::top(args, &mut out, terminal)) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(1),
        Err(code) => code,
    }
}

fn agent_error_code(e: &rlaunch_agent::AgentError) -> i32 {
    match e {
        rlaunch_agent::AgentError::Spawn { source, .. } if source.kind() == std::io::ErrorKind::NotFound => 127,
        rlaunch_agent::AgentError::Spawn { source, .. } if source.kind() == std::io::ErrorKind::PermissionDenied => 126,
        _ => 1,
    }
}

fn init_tracing() {
    let filter = tracing_subscriber::EnvFilter::try_from_env("RLAUNCH_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    use std::io::IsTerminal;
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .with_target(false)
        .compact()
        .init();
}
