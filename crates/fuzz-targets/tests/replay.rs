//! The test tier's share of fuzzing: every target replays its corpus
//! (`fuzz/corpus/<target>/`: what libFuzzer kept, and every input that once
//! made a target fail), then runs mutations of it for a short time
//! (`EVPLEG_FUZZ_SECONDS`, 2 s per target by default; the seed is printed and
//! `EVPLEG_FUZZ_SEED` replays it). No coverage guidance here: that is
//! `cargo xtask fuzz`. What fails: a panic, or an input that takes longer than
//! [`HANG`]. A failing input is written to `target/fuzz-failures/` and named.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use evpleg_fuzz_targets::{TARGETS, seed};

/// Longer than this for one input is a hang (inputs are at most
/// [`MAX_LEN`] bytes; the slowest target takes well under 10 ms for one in a
/// debug build).
const HANG: Duration = Duration::from_secs(2);
/// The largest input the mutations make.
const MAX_LEN: usize = 8 * 1024;

fn corpus_dir(target: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../fuzz/corpus")
        .join(target)
}

fn corpus(target: &str) -> Vec<Vec<u8>> {
    let dir = corpus_dir(target);
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.expect("a directory entry").path())
        .collect();
    files.sort();
    files
        .iter()
        .map(|f| std::fs::read(f).unwrap_or_else(|e| panic!("{}: {e}", f.display())))
        .collect()
}

/// xorshift64*: the mutations' randomness, reproducible from the seed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

/// One mutation of `input` (bit flip, byte set, insert, delete, duplicate,
/// splice with `other`, truncate), as libFuzzer's simplest mutators.
fn mutate(rng: &mut Rng, input: &mut Vec<u8>, other: &[u8]) {
    let len = input.len();
    match rng.below(7) {
        0 if len > 0 => {
            let i = rng.below(len);
            input[i] ^= 1 << rng.below(8);
        }
        1 if len > 0 => {
            let i = rng.below(len);
            input[i] = rng.next() as u8;
        }
        2 => input.insert(rng.below(len + 1), rng.next() as u8),
        3 if len > 0 => {
            let from = rng.below(len);
            let to = (from + 1 + rng.below(16)).min(len);
            input.drain(from..to);
        }
        4 if len > 0 => {
            let from = rng.below(len);
            let to = (from + 1 + rng.below(64)).min(len);
            let piece = input[from..to].to_vec();
            let at = rng.below(len + 1);
            input.splice(at..at, piece);
        }
        5 if !other.is_empty() => {
            let cut = rng.below(len + 1);
            let from = rng.below(other.len());
            input.truncate(cut);
            input.extend_from_slice(&other[from..]);
        }
        _ => input.truncate(rng.below(len + 1)),
    }
    input.truncate(MAX_LEN);
}

/// Runs `f` on `input`; on a panic or a hang, writes the input out and fails
/// naming it.
fn run_one(name: &str, f: fn(&[u8]), input: &[u8]) {
    let start = Instant::now();
    let outcome = catch_unwind(AssertUnwindSafe(|| f(input)));
    let took = start.elapsed();
    if outcome.is_err() || took > HANG {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target/fuzz-failures");
        std::fs::create_dir_all(&dir).expect("target/fuzz-failures");
        let file = dir.join(format!("{name}-{:016x}", fnv(input)));
        std::fs::write(&file, input).expect("write the failing input");
        panic!(
            "{name}: {} on the input written to {} (took {took:?})",
            if outcome.is_err() {
                "a panic"
            } else {
                "a hang"
            },
            file.display()
        );
    }
}

fn fnv(data: &[u8]) -> u64 {
    data.iter().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x100_0000_01b3)
    })
}

#[test]
fn every_target_survives_its_corpus_and_seconds_of_mutations() {
    let seconds: u64 = std::env::var("EVPLEG_FUZZ_SECONDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(2);
    let seed = seed() | 1;
    eprintln!("mutation seed {seed} (EVPLEG_FUZZ_SEED replays it)");
    let mut rng = Rng(seed);
    for (name, f) in TARGETS {
        let corpus = corpus(name);
        assert!(
            corpus.len() >= 3,
            "{name}: {} has {} inputs; run `cargo xtask fuzz {name}` to grow it",
            corpus_dir(name).display(),
            corpus.len()
        );
        for input in &corpus {
            run_one(name, *f, input);
        }
        let deadline = Instant::now() + Duration::from_secs(seconds);
        let mut runs = 0u64;
        while Instant::now() < deadline {
            let mut input = corpus[rng.below(corpus.len())].clone();
            let other = &corpus[rng.below(corpus.len())];
            for _ in 0..=rng.below(4) {
                mutate(&mut rng, &mut input, other);
            }
            run_one(name, *f, &input);
            runs += 1;
        }
        eprintln!("{name}: {} corpus inputs, {runs} mutations", corpus.len());
        assert!(runs > 0, "{name}: no mutation ran in {seconds} s");
    }
}

#[test]
fn a_panicking_target_is_caught_and_its_input_kept() {
    fn panics_on_x(data: &[u8]) {
        assert!(!data.contains(&b'x'), "an x");
    }
    run_one("selftest", panics_on_x, b"fine");
    let caught = catch_unwind(|| run_one("selftest", panics_on_x, b"an x"));
    let message = caught.expect_err("the panic is reported");
    let text = message
        .downcast_ref::<String>()
        .expect("a formatted message");
    assert!(
        text.contains("selftest: a panic on the input written to"),
        "{text}"
    );
    let path = text
        .split("written to ")
        .nth(1)
        .and_then(|rest| rest.split(" (took").next())
        .expect("the path");
    assert_eq!(std::fs::read(path).expect("the kept input"), b"an x");
    std::fs::remove_file(path).expect("remove the kept input");
}

#[test]
fn the_libfuzzer_binaries_and_the_corpora_are_the_targets() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz");
    let names = |dir: &str, suffix: &str| -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(root.join(dir))
            .unwrap_or_else(|e| panic!("fuzz/{dir}: {e}"))
            .map(|e| {
                e.expect("an entry")
                    .file_name()
                    .to_string_lossy()
                    .into_owned()
            })
            .filter_map(|n| n.strip_suffix(suffix).map(str::to_owned))
            .collect();
        v.sort();
        v
    };
    let mut targets: Vec<String> = TARGETS.iter().map(|(n, _)| (*n).to_owned()).collect();
    targets.sort();
    assert_eq!(names("fuzz_targets", ".rs"), targets);
    assert_eq!(names("corpus", ""), targets);
}
