//! Two sidecar replicas sharing state through a real redis-server: they
//! agree on a session's worker within 100 ms, a replica restarted warm
//! answers with the overlap it had, and when Redis dies and returns, Picks
//! never stop and the replicas converge.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use kvmesh_integration::cluster::start_sidecar;
use kvmesh_integration::paths::Profile;
use kvmesh_integration::process::Process;
use kvmesh_integration::redis::RedisServer;
use kvmesh_proto::v1::router_client::RouterClient;
use kvmesh_proto::v1::{PickReply, PickRequest};
use tonic::transport::Channel;

const WORKERS: [&str; 3] = ["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"];

struct Replica {
    process: Process,
    grpc: SocketAddr,
    admin: SocketAddr,
    client: RouterClient<Channel>,
    dir: PathBuf,
}

fn scratch(name: &str) -> anyhow::Result<PathBuf> {
    let dir = std::env::temp_dir().join(format!("kvmesh-replicas-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    Ok(dir)
}

async fn replica(dir: &Path, redis: &str, grpc: SocketAddr) -> anyhow::Result<Replica> {
    std::fs::create_dir_all(dir)?;
    let workers: Vec<SocketAddr> = WORKERS.iter().map(|w| w.parse()).collect::<Result<_, _>>()?;
    let args: Vec<String> = [
        "--redis",
        redis,
        "--cluster",
        "it",
        // The workers are placeholders: nothing to scrape.
        "--scrape-interval-ms",
        "0",
        "--snapshot-interval-secs",
        "1",
    ]
    .iter()
    .map(|s| (*s).to_owned())
    .collect();
    let (process, grpc, admin) = start_sidecar(dir, Profile::Debug, grpc, &workers, &args)?;
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{grpc}"))?
        .connect()
        .await?;
    Ok(Replica {
        process,
        grpc,
        admin,
        client: RouterClient::new(channel),
        dir: dir.to_path_buf(),
    })
}

fn request(session: &str, family: u64, blocks: u64) -> PickRequest {
    PickRequest {
        block_hashes: (0..blocks).map(|i| (family << 32) | i).collect(),
        block_bytes: 256,
        prompt_bytes: blocks * 256,
        session_id: session.to_owned(),
        ..PickRequest::default()
    }
}

async fn pick(r: &mut Replica, req: PickRequest) -> anyhow::Result<PickReply> {
    Ok(r.client.pick(req).await?.into_inner())
}

/// The home a replica's /debug/sessions shows for `session`.
async fn home(http: &reqwest::Client, r: &Replica, session: &str) -> anyhow::Result<Option<String>> {
    let view: serde_json::Value = http
        .get(format!("http://{}/debug/sessions", r.admin))
        .send()
        .await?
        .json()
        .await?;
    Ok(view["sessions"]
        .as_array()
        .and_then(|all| all.iter().find(|s| s["session"] == session))
        .and_then(|s| s["home"].as_str().map(str::to_owned)))
}

async fn wait_for_home(
    http: &reqwest::Client,
    r: &Replica,
    session: &str,
    want: &str,
    within: Duration,
) -> anyhow::Result<Duration> {
    let started = Instant::now();
    loop {
        if home(http, r, session).await?.as_deref() == Some(want) {
            return Ok(started.elapsed());
        }
        anyhow::ensure!(
            started.elapsed() < within,
            "{session} never reached home {want} on {}",
            r.grpc
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_agree_restart_warm_and_survive_redis() -> anyhow::Result<()> {
    let dir = scratch("all")?;
    let mut redis = RedisServer::start(&dir)?;
    let any: SocketAddr = "127.0.0.1:0".parse()?;
    let mut a = replica(&dir.join("a"), &redis.url(), any).await?;
    let mut b = replica(&dir.join("b"), &redis.url(), any).await?;
    let http = reqwest::Client::builder().no_proxy().build()?;

    // Agreement: a decision on A is known to B within 100 ms.
    let mut worst = Duration::ZERO;
    for s in 0..5u64 {
        let session = format!("agree-{s}");
        let first = pick(&mut a, request(&session, s, 40)).await?;
        let took = wait_for_home(&http, &b, &session, &first.destinations[0], Duration::from_secs(5)).await?;
        worst = worst.max(took);
        let next = pick(&mut b, request(&session, s, 44)).await?;
        assert_eq!(next.destinations[0], first.destinations[0], "{session}");
        assert_eq!(next.predicted_cached_blocks, 40, "{session}");
    }
    assert!(
        worst < Duration::from_millis(100),
        "replicas agreed only after {worst:?}"
    );
    eprintln!("replicas agreed within {worst:?}");

    // Warm restart: A stops (writing a snapshot) and comes back knowing
    // every session's prefix.
    let mut before = Vec::new();
    for s in 10..16u64 {
        let session = format!("warm-{s}");
        let reply = pick(&mut a, request(&session, s, 30)).await?;
        before.push((session, s, reply.destinations[0].clone()));
    }
    let grpc = a.grpc;
    let a_dir = a.dir.clone();
    a.process.stop();
    drop(a);
    let mut a = replica(&a_dir, &redis.url(), grpc).await?;
    for (session, s, worker) in &before {
        let reply = pick(&mut a, request(session, *s, 34)).await?;
        assert_eq!(
            (&reply.destinations[0], reply.predicted_cached_blocks),
            (worker, 30),
            "{session} after restart"
        );
    }

    // Redis dies: Picks go on from memory, quickly.
    redis.kill()?;
    let mut outage = Vec::new();
    for s in 20..26u64 {
        let session = format!("outage-{s}");
        let started = Instant::now();
        let reply = pick(&mut a, request(&session, s, 20)).await?;
        assert!(started.elapsed() < Duration::from_millis(50), "a Pick waited on redis");
        outage.push((session, reply.destinations[0].clone()));
    }
    // Redis returns empty; what A decided meanwhile reaches B.
    redis.restart()?;
    for (session, worker) in &outage {
        wait_for_home(&http, &b, session, worker, Duration::from_secs(15)).await?;
    }
    let reply = pick(&mut b, request(&outage[0].0, 20, 24)).await?;
    assert_eq!(
        (&reply.destinations[0], reply.predicted_cached_blocks),
        (&outage[0].1, 20)
    );

    a.process.stop();
    b.process.stop();
    redis.kill()?;
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}
