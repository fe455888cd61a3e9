//! Faults during a steady load of sixteen agent sessions through the real
//! Envoy: the sidecar killed, stalled past the filter's timeout and
//! restarted; Redis killed and restarted; a worker killed and restarted with
//! its cache wiped. Every request kvmesh is responsible for succeeds, no new
//! request goes to the dead worker once it is detected, the router learns
//! that the restarted worker's cache is empty, and nothing that an outcome
//! could release stays in flight (a Pick the filter gave up on gets none).
//!
//! Prints one report line per phase (requests, errors, errors caused by
//! kvmesh, median latency against the baseline) for docs/reliability.md.
//!
//! Every half of a phase lasts until each of the sixteen sessions has
//! completed a request started in it (so each went through the fault), and
//! at least its 3 s; the last one also until the restarted worker has
//! served a request. What is asserted is counted, not timed: errors, where
//! requests were ranked and served, the router's restart counter. The waits
//! poll for what they wait for, with deadlines that only bound a hang, so a
//! slow machine makes the run longer, not different.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use kvmesh_integration::process::Signal;
use kvmesh_integration::{AgentSession, Cluster, ClusterOptions};
use tokio::sync::Mutex;

const SESSIONS: usize = 16;
const TIMEOUT_MS: u64 = 100;
/// Turns per session before it starts over as a new session, so bodies stay
/// the size of a working agent's, not of one that never ends.
const TURNS: usize = 12;
/// The least each half of a phase lasts (the report's phases are 6 s).
const HALF_PHASE: Duration = Duration::from_secs(3);
/// Deadline of any wait: only bounds a hang.
const HANG: Duration = Duration::from_secs(120);

/// One request of the load, as the client saw it.
#[derive(Debug, Clone)]
struct Sent {
    session: usize,
    /// Which of the session's successive ids (`load-{session}-{generation}`).
    generation: usize,
    started: Instant,
    latency: Duration,
    /// 200, another status, or `None` when the connection failed.
    status: Option<u16>,
    worker: Option<String>,
    /// The first destination kvmesh ranked, if it ranked any.
    picked: Option<String>,
    /// The reply body of a failed request, for the failure message.
    error: Option<String>,
}

async fn run_session(
    envoy_url: String,
    s: usize,
    stop: Arc<AtomicBool>,
    log: Arc<Mutex<Vec<Sent>>>,
) -> anyhow::Result<()> {
    let http = reqwest::Client::builder().no_proxy().build()?;
    let mut generation = 0;
    while !stop.load(Ordering::Relaxed) {
        let session = AgentSession::new(&format!("load/service-{s}-{generation}"));
        let id = format!("load-{s}-{generation}");
        for turn in 0..TURNS {
            if stop.load(Ordering::Relaxed) {
                break;
            }
            let started = Instant::now();
            let response = http
                .post(format!("{envoy_url}/v1/chat/completions"))
                .header("content-type", "application/json")
                .header("x-session-id", &id)
                .body(session.call(turn).to_string())
                .send()
                .await;
            let header = |r: &reqwest::Response, name: &str| {
                r.headers().get(name).and_then(|v| v.to_str().ok()).map(str::to_owned)
            };
            let sent = match response {
                Ok(r) => {
                    let status = Some(r.status().as_u16());
                    let worker = header(&r, "x-kvmesh-sim-worker");
                    let picked =
                        header(&r, "x-kvmesh-sim-saw-destination").and_then(|d| d.split(',').next().map(str::to_owned));
                    let body = r.bytes().await;
                    let error = match &body {
                        Ok(b) if status != Some(200) => Some(String::from_utf8_lossy(b).into_owned()),
                        Ok(_) => None,
                        Err(e) => Some(e.to_string()),
                    };
                    Sent {
                        session: s,
                        generation,
                        started,
                        latency: started.elapsed(),
                        status: status.filter(|_| body.is_ok()),
                        worker,
                        picked,
                        error,
                    }
                }
                Err(e) => Sent {
                    session: s,
                    generation,
                    started,
                    latency: started.elapsed(),
                    status: None,
                    worker: None,
                    picked: None,
                    error: Some(e.to_string()),
                },
            };
            log.lock().await.push(sent);
        }
        generation += 1;
    }
    Ok(())
}

/// Waits until `check` holds on the sidecar's view of `address`.
async fn wait_for_worker(
    cluster: &Cluster,
    address: &str,
    what: &str,
    check: impl Fn(&serde_json::Value) -> bool,
) -> anyhow::Result<Duration> {
    let started = Instant::now();
    loop {
        let workers = cluster.sidecar_workers().await.unwrap_or_default();
        if workers.iter().any(|w| w["address"] == address && check(w)) {
            return Ok(started.elapsed());
        }
        anyhow::ensure!(started.elapsed() < HANG, "{address} never {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Lets the load run until `HALF_PHASE` has passed since `from`, every
/// session has completed a request it started since then, and `also` holds
/// of the requests completed so far; returns when it ended.
async fn hold(
    log: &Mutex<Vec<Sent>>,
    from: Instant,
    what: &str,
    also: impl Fn(&[Sent]) -> bool,
) -> anyhow::Result<Instant> {
    loop {
        let now = Instant::now();
        if now >= from + HALF_PHASE {
            let log = log.lock().await;
            let mut seen = [false; SESSIONS];
            for r in log.iter().filter(|r| r.started >= from) {
                seen[r.session] = true;
            }
            let idle: Vec<usize> = (0..SESSIONS).filter(|s| !seen[*s]).collect();
            if idle.is_empty() && also(&log) {
                return Ok(now);
            }
            anyhow::ensure!(
                now < from + HANG,
                "{what}: after {HANG:?} sessions {idle:?} completed no request"
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Any request.
fn anything(_: &[Sent]) -> bool {
    true
}

struct Phase {
    name: &'static str,
    from: Instant,
    to: Instant,
}

fn quantile(mut latencies: Vec<Duration>, q: f64) -> Duration {
    latencies.sort();
    let at = ((latencies.len().max(1) - 1) as f64 * q) as usize;
    latencies.get(at).copied().unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixteen_sessions_ride_through_every_fault() -> anyhow::Result<()> {
    let mut cluster = Cluster::start(ClusterOptions {
        workers: 4,
        plugin: serde_json::json!({ "sidecar_timeout_ms": TIMEOUT_MS }),
        // Some engine time, so requests overlap and are in flight at faults.
        sim_args: vec!["--time-scale".into(), "0.2".into()],
        redis: true,
        ..ClusterOptions::default()
    })
    .await?;
    let stop = Arc::new(AtomicBool::new(false));
    let log = Arc::new(Mutex::new(Vec::new()));
    let load: Vec<_> = (0..SESSIONS)
        .map(|s| tokio::spawn(run_session(cluster.envoy_url.clone(), s, stop.clone(), log.clone())))
        .collect();
    let mut phases = Vec::new();

    // The baseline: two halves' worth, every session twice over.
    let from = Instant::now();
    let half = hold(&log, from, "baseline", anything).await?;
    let to = hold(&log, half, "baseline", anything).await?;
    phases.push(Phase {
        name: "baseline",
        from,
        to,
    });

    let from = Instant::now();
    // Picks from here on go to the sidecar that serves to the end, or none.
    let last_sidecar_from = from;
    cluster.kill_sidecar()?;
    hold(&log, from, "sidecar killed", anything).await?;
    cluster.restart_sidecar()?;
    let to = hold(&log, Instant::now(), "sidecar restarted", anything).await?;
    phases.push(Phase {
        name: "sidecar killed, restarted",
        from,
        to,
    });

    let from = Instant::now();
    cluster.sidecar.signal(Signal::SIGSTOP)?;
    hold(&log, from, "sidecar stalled", anything).await?;
    cluster.sidecar.signal(Signal::SIGCONT)?;
    let to = hold(&log, Instant::now(), "sidecar resumed", anything).await?;
    phases.push(Phase {
        name: "sidecar stalled (SIGSTOP)",
        from,
        to,
    });

    let from = Instant::now();
    let redis = cluster.redis.as_mut().ok_or_else(|| anyhow::anyhow!("no redis"))?;
    redis.kill()?;
    hold(&log, from, "Redis killed", anything).await?;
    redis.restart()?;
    let to = hold(&log, Instant::now(), "Redis restarted", anything).await?;
    phases.push(Phase {
        name: "Redis killed, restarted",
        from,
        to,
    });

    // A worker dies with requests on it, then comes back with an empty cache.
    let victim = 0;
    let dead = cluster.workers[victim].addr.to_string();
    let restarts_before = cluster
        .sidecar_metric("kvmesh_worker_events_total{event=\"restart\"}")
        .await
        .unwrap_or(0.0);
    let from = Instant::now();
    let dying_from = from;
    cluster.workers[victim].process.kill()?;
    // It died somewhere between `from` and here (the kill waits for it).
    let killed_at = Instant::now();
    let detection = wait_for_worker(&cluster, &dead, "was marked down", |w| w["healthy"] == false).await?;
    let detected_at = Instant::now();
    let down_until = hold(&log, detected_at, "worker down", anything).await?;
    cluster.restart_worker(victim)?;
    wait_for_worker(&cluster, &dead, "came back", |w| w["healthy"] == true).await?;
    // The scrape that finds it back also sees the restart; polled all the
    // same, as a count that must rise.
    let mut restarts_after = restarts_before;
    let deadline = Instant::now() + HANG;
    while restarts_after <= restarts_before && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
        restarts_after = cluster
            .sidecar_metric("kvmesh_worker_events_total{event=\"restart\"}")
            .await?;
    }
    // Back: until the restarted worker has served a request.
    let back_at = Instant::now();
    let served_by_restarted = |log: &[Sent]| {
        log.iter()
            .any(|r| r.started > down_until && r.worker.as_deref() == Some(dead.as_str()))
    };
    let to = hold(&log, back_at, "worker restarted", served_by_restarted).await?;
    phases.push(Phase {
        name: "worker killed, restarted empty",
        from,
        to,
    });

    stop.store(true, Ordering::Relaxed);
    for task in load {
        task.await??;
    }
    let log = log.lock().await.clone();

    // Nothing stays in flight that an outcome could release. The sidecar
    // holds a pick in flight until its outcome comes or the session's next
    // Pick; a Pick the filter gave up on (past its 100 ms timeout: the stall,
    // or a slow Pick on a loaded machine) is answered later, routes nothing
    // and gets no outcome. So only a session id whose last request failed
    // open may leave one pick behind; every other one must be released.
    let mut last: HashMap<(usize, usize), &Sent> = HashMap::new();
    for r in &log {
        let entry = last.entry((r.session, r.generation)).or_insert(r);
        if r.started > entry.started {
            *entry = r;
        }
    }
    let may_stay = last
        .values()
        .filter(|r| r.started >= last_sidecar_from && r.picked.is_none())
        .count() as u64;
    let deadline = Instant::now() + HANG;
    let left = loop {
        let left: u64 = cluster
            .sidecar_workers()
            .await?
            .iter()
            .filter_map(|w| w["in_flight"].as_u64())
            .sum();
        if left <= may_stay || Instant::now() > deadline {
            break left;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    eprintln!(
        "left in flight: {left} (of {} session ids, {may_stay} ended on a request that failed open)",
        last.len()
    );
    assert!(
        left <= may_stay,
        "{left} picks still in flight, but only {may_stay} session ids ended on a request that failed open"
    );

    for stat in [
        "upstream_rq_retry",
        "upstream_rq_retry_overflow",
        "upstream_cx_destroy_remote_with_active_rq",
    ] {
        let value = cluster.envoy_counter(&format!("cluster.gpu_workers.{stat}")).await?;
        eprintln!("envoy {stat} = {value}");
    }
    let in_baseline = || {
        log.iter()
            .filter(|r| r.started >= phases[0].from && r.started < phases[0].to)
            .map(|r| r.latency)
    };
    let (baseline, baseline_p99) = (
        quantile(in_baseline().collect(), 0.5),
        quantile(in_baseline().collect(), 0.99),
    );
    eprintln!("worker death detected in {detection:?}");
    eprintln!("| phase | requests | errors | caused by kvmesh | median | added | p99 | added |");
    for phase in &phases {
        let during: Vec<&Sent> = log
            .iter()
            .filter(|r| r.started >= phase.from && r.started < phase.to)
            .collect();
        let errors: Vec<&&Sent> = during.iter().filter(|r| r.status != Some(200)).collect();
        // Only requests in flight when the worker died may fail: started
        // before it was dead, ended after it was killed.
        let kvmesh_errors = errors
            .iter()
            .filter(|r| !(r.started < killed_at && r.started + r.latency >= dying_from))
            .count();
        let latency = quantile(during.iter().map(|r| r.latency).collect(), 0.5);
        let p99 = quantile(during.iter().map(|r| r.latency).collect(), 0.99);
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        eprintln!(
            "| {} | {} | {} | {} | {:.1} ms | {:+.1} ms | {:.1} ms | {:+.1} ms |",
            phase.name,
            during.len(),
            errors.len(),
            kvmesh_errors,
            ms(latency),
            ms(latency) - ms(baseline),
            ms(p99),
            ms(p99) - ms(baseline_p99),
        );
        assert!(
            during.len() >= SESSIONS,
            "{}: too little load ({})",
            phase.name,
            during.len()
        );
        let reasons: Vec<&str> = errors.iter().filter_map(|r| r.error.as_deref()).collect();
        assert_eq!(kvmesh_errors, 0, "{}: errors caused by kvmesh: {reasons:?}", phase.name);
    }
    // Once detected dead, the worker is picked for nothing until it is back.
    let sent_to_dead: Vec<&Sent> = log
        .iter()
        .filter(|r| r.started > detected_at && r.started < down_until)
        .filter(|r| r.picked.as_deref() == Some(dead.as_str()) || r.worker.as_deref() == Some(dead.as_str()))
        .collect();
    assert!(sent_to_dead.is_empty(), "picked the dead worker: {sent_to_dead:?}");
    // Back with an empty cache: the watcher saw the restart and forgot its blocks.
    assert!(
        restarts_after > restarts_before,
        "the router never learned the worker restarted ({restarts_before} -> {restarts_after})"
    );
    // And it takes work again.
    assert!(
        log.iter()
            .any(|r| r.started > down_until && r.worker.as_deref() == Some(dead.as_str())),
        "the restarted worker got no requests"
    );
    Ok(())
}
