//! The demo the README shows runs with one command and checks itself: it exits with success
//! only if every booking was resumed once and never charged twice.

use std::process::Command;

#[test]
fn the_demo_crashes_resumes_and_passes_its_checks() {
    let out = Command::new(env!("CARGO_BIN_EXE_rides-api"))
        .env("RUST_LOG", "error")
        .output()
        .expect("run the demo");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "the demo failed: {}\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    for line in [
        "ok: resumed at the charge: one ride, one charge, one receipt",
        "ok: a later retry replays the same booking",
        "ok: the client's late retry gets the completed booking",
    ] {
        assert!(stdout.contains(line), "missing {line:?} in:\n{stdout}");
    }
    assert!(!stdout.contains("FAILED"), "{stdout}");
}
