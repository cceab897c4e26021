//! The `kvfabric` command-line binary.

use std::process::ExitCode;

use clap::Parser;

mod cli;

fn main() -> ExitCode {
    if let Err(e) = cli::apply_config_file().and_then(|()| cli::tls::apply_secret_files()) {
        eprintln!("error: {}", cli::one_line(&e));
        return ExitCode::from(2);
    }
    let args = match cli::Cli::try_parse() {
        Ok(args) => args,
        Err(e) => {
            use clap::error::ErrorKind;
            if matches!(e.kind(), ErrorKind::DisplayHelp | ErrorKind::DisplayVersion)
                || matches!(e.kind(), ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand)
            {
                let _ = e.print();
                return ExitCode::SUCCESS;
            }
            // One line, not clap's multi-line usage dump.
            let text = e.to_string();
            let first = text.lines().next().unwrap_or("error: invalid arguments");
            eprintln!("{first} (see --help)");
            return ExitCode::from(2);
        }
    };
    match cli::run(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {}", cli::one_line(&e));
            ExitCode::FAILURE
        }
    }
}
