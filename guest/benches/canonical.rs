//! The canonicalizer, natively, against two references measured in the
//! same run, interleaved round by round:
//!
//! - `tree`: this crate's own tree-building path (what [`select`] uses,
//!   here with the empty pointer, so it canonicalizes the whole document);
//! - `serde_json_canonicalizer`: a maintained RFC 8785 crate;
//! - `exact numbers (v2)`: the same canonicalizer with fingerprint version
//!   2's numbers ([`Numbers::Exact`]), what the engine hashes now.
//!
//! `cargo bench -p idem-guest --bench canonical` (add `-- --smoke` for a
//! tiny run). Prints µs per document and each reference ÷ `canonicalize`.

use std::hint::black_box;
use std::time::{Duration, Instant};

use anyhow::{Result, ensure};
use idem_guest::canonical::{Numbers, canonicalize, canonicalize_as, select};

// The same bodies as the host suite's guest measurements.
#[path = "../../host/benches/suite/body.rs"]
mod body;
use body::json_body;

/// Rounds of the interleaved measurement; the median round is reported.
const ROUNDS: usize = 7;

/// Bytes of JSON canonicalized per round and contender, so that every
/// body size gets a comparable amount of work (and timer noise stays far
/// below the figure).
const BYTES_PER_ROUND: usize = 4 << 20;

fn per_doc(reps: usize, mut f: impl FnMut() -> Result<usize>) -> Result<Duration> {
    let at = Instant::now();
    for _ in 0..reps {
        black_box(f()?);
    }
    Ok(at.elapsed() / u32::try_from(reps)?)
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort_unstable();
    v[v.len() / 2]
}

fn main() -> Result<()> {
    let smoke = std::env::args().any(|a| a == "--smoke");
    let (rounds, budget) = if smoke {
        (1, 64 << 10)
    } else {
        (ROUNDS, BYTES_PER_ROUND)
    };
    let whole = vec![String::new()];
    if smoke {
        println!("smoke run: tiny counts, a check that the bench works, not a measurement");
    }
    println!(
        "| body | canonicalize | tree | tree ÷ canonicalize | serde_json_canonicalizer | it ÷ canonicalize | exact numbers (v2) | v2 ÷ canonicalize |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    for (size, label) in [(200, "200 B"), (4 << 10, "4 KiB"), (64 << 10, "64 KiB")] {
        let body = json_body(size);
        let text = body.as_bytes();
        // Same answer from all three, or the comparison means nothing.
        let ours = canonicalize(text)?;
        let tree = select(text, &whole)?;
        ensure!(
            tree == [b"{\"\":", &ours[..], b"}"].concat(),
            "tree path differs"
        );
        let theirs = serde_json_canonicalizer::pipe(&body)?;
        ensure!(theirs.as_bytes() == ours, "reference crate differs");
        // Fingerprint version 2 writes ordinary numbers as RFC 8785 does.
        ensure!(
            canonicalize_as(text, Numbers::Exact)? == ours,
            "version 2 differs"
        );

        let reps = (budget / size).max(1);
        let (mut a, mut b, mut c, mut d) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for _ in 0..rounds {
            a.push(per_doc(reps, || Ok(canonicalize(black_box(text))?.len()))?);
            b.push(per_doc(
                reps,
                || Ok(select(black_box(text), &whole)?.len()),
            )?);
            c.push(per_doc(reps, || {
                Ok(serde_json_canonicalizer::pipe(black_box(&body))?.len())
            })?);
            d.push(per_doc(reps, || {
                Ok(canonicalize_as(black_box(text), Numbers::Exact)?.len())
            })?);
        }
        let (a, b, c, d) = (median(a), median(b), median(c), median(d));
        let us = |d: Duration| d.as_secs_f64() * 1e6;
        println!(
            "| {label} | {:.2} µs | {:.2} µs | {:.2} | {:.2} µs | {:.2} | {:.2} µs | {:.2} |",
            us(a),
            us(b),
            us(b) / us(a),
            us(c),
            us(c) / us(a),
            us(d),
            us(d) / us(a)
        );
    }
    Ok(())
}
