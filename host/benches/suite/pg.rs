//! The engine on PostgreSQL against bare SQL on the same server, with the
//! same paths and thread counts as on SQLite. Needs `IDEM_TEST_PG_URL`;
//! without it the part says it was skipped.
//!
//! The baseline: `INSERT … ON CONFLICT DO NOTHING RETURNING id` of a
//! processing row, then a second transaction `UPDATE` to succeeded (new
//! key); one `SELECT` by the unique key (replay, mismatch). Prepared
//! statements on one connection per thread, in a table with the store's
//! own schema; the engine runs with the store's defaults.

use std::sync::Mutex;

use anyhow::{Context, Result, anyhow, ensure};
use idem::{Engine, PostgresOptions, PostgresStore, RecordKey};
use postgres::{Client, NoTls, Statement};

use crate::bare::now_ms;
use crate::common::{
    Compared, Path, Report, STORED_KEYS, Samples, Settings, engine_op, idle_note, key_for, round,
    stored_key,
};

struct Bare {
    client: Client,
    insert: Statement,
    settle: Statement,
    select: Statement,
}

impl Bare {
    fn connect(url: &str, schema: &str) -> Result<Bare> {
        let mut client = Client::connect(url, NoTls)?;
        let table = format!("\"{schema}\".idempotency_record");
        let insert = client.prepare(&format!(
            "INSERT INTO {table} (scope_key, biz_type, idem_key, request_hash, \
             fingerprint_version, status, fencing_token, revision, attempts, lease_until, \
             created_at, updated_at) \
             VALUES ($1, $2, $3, $4, 1, 'processing', 1, 1, 1, $5, $6, $6) \
             ON CONFLICT (scope_key, biz_type, idem_key) DO NOTHING RETURNING id"
        ))?;
        let settle = client.prepare(&format!(
            "UPDATE {table} SET status = 'succeeded', revision = 2, lease_until = NULL, \
             expires_at = $2, updated_at = $3, result_ref = $4 WHERE id = $1 AND revision = 1"
        ))?;
        let select = client.prepare(&format!(
            "SELECT id, scope_key, biz_type, idem_key, request_hash, fingerprint_version, \
             status, fencing_token, revision, attempts, lease_until, created_at, updated_at, \
             expires_at, result_ref, response, failure FROM {table} \
             WHERE scope_key = $1 AND biz_type = $2 AND idem_key = $3"
        ))?;
        Ok(Bare {
            client,
            insert,
            settle,
            select,
        })
    }

    fn op(&mut self, path: Path, key: &RecordKey) -> Result<()> {
        match path {
            Path::NewKey => {
                let now = now_ms();
                let row = self.client.query_one(
                    &self.insert,
                    &[
                        &key.scope,
                        &key.biz_type,
                        &key.idem_key,
                        &"ab".repeat(32),
                        &(now + 60_000),
                        &now,
                    ],
                )?;
                let id: i64 = row.get(0);
                let n = self.client.execute(
                    &self.settle,
                    &[&id, &(now + 86_400_000), &now, &b"order-1".as_slice()],
                )?;
                ensure!(n == 1);
            }
            Path::Replay | Path::Mismatch => {
                let row = self
                    .client
                    .query_opt(&self.select, &[&key.scope, &key.biz_type, &key.idem_key])?;
                ensure!(row.is_some(), "stored key {key:?} missing");
            }
        }
        Ok(())
    }
}

fn drop_schema(url: &str, schema: &str) -> Result<()> {
    Client::connect(url, NoTls)?
        .batch_execute(&format!("DROP SCHEMA IF EXISTS \"{schema}\" CASCADE"))?;
    Ok(())
}

/// Runs the PostgreSQL measurements.
pub fn run(settings: &Settings, report: &mut Report) -> Result<()> {
    let Some(url) = std::env::var("IDEM_TEST_PG_URL")
        .ok()
        .filter(|u| !u.is_empty())
    else {
        println!("\npostgres: skipped, IDEM_TEST_PG_URL is not set, so there is no server");
        return Ok(());
    };
    let tag = std::process::id();
    let schemas = [
        format!("idem_bench_engine_{tag}"),
        format!("idem_bench_bare_{tag}"),
    ];
    let result = measure(settings, report, &url, &schemas);
    for s in &schemas {
        drop_schema(&url, s)?;
    }
    result
}

fn measure(
    settings: &Settings,
    report: &mut Report,
    url: &str,
    schemas: &[String; 2],
) -> Result<()> {
    let max_threads = settings.threads.iter().copied().max().unwrap_or(1);
    let open = |schema: &str, pool: usize| {
        PostgresStore::connect(
            url,
            PostgresOptions {
                schema: schema.to_owned(),
                pool_size: u32::try_from(pool)?,
                ..PostgresOptions::default()
            },
        )
        .map_err(anyhow::Error::from)
    };
    let engine = Engine::builder()
        .storage(open(&schemas[0], max_threads)?)
        .build()?;
    // The bare table: the store's own schema, created by a store.
    drop(open(&schemas[1], 1)?);
    let bare: Vec<Mutex<Bare>> = (0..max_threads)
        .map(|_| Bare::connect(url, &schemas[1]).map(Mutex::new))
        .collect::<Result<_>>()?;
    let lock = |t: usize| {
        bare[t]
            .lock()
            .map_err(|_| anyhow!("a baseline connection was poisoned"))
    };
    let stored = if settings.smoke { 50 } else { STORED_KEYS };
    for i in 0..stored {
        engine_op(&engine, Path::NewKey, &stored_key(i))?;
        lock(0)?.op(Path::NewKey, &stored_key(i))?;
    }
    // New keys name the run (side and thread count), so runs never collide.
    let key = |path, who: &str, threads: usize, r, t, i| {
        key_for(path, &format!("{who}{threads}"), r, t, i, stored)
    };
    Report::compared_header(&format!(
        "PostgreSQL, engine against bare SQL: {} rounds x {} operations per thread{}",
        settings.rounds,
        settings.ops,
        idle_note(settings)
    ));
    for path in Path::ALL {
        for &threads in &settings.threads {
            let (mut b, mut e) = (Samples::default(), Samples::default());
            for r in 0..settings.rounds {
                round(threads, settings.ops, settings.idle_gap, &mut b, |t, i| {
                    lock(t)?.op(path, &key(path, "bare", threads, r, t, i))
                })
                .context("bare SQL")?;
                round(threads, settings.ops, settings.idle_gap, &mut e, |t, i| {
                    engine_op(&engine, path, &key(path, "idem", threads, r, t, i))
                })
                .context("engine")?;
            }
            report.compared(Compared {
                section: "postgres",
                path,
                threads,
                bare: b,
                idem: e,
            });
        }
    }
    Ok(())
}
