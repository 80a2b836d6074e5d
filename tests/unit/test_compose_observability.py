"""compose/'s observability: Prometheus config, Grafana provisioning and dashboard, and the
workers' health checks, checked against the compose files and against the metrics the
code really defines.

- `promtool check config compose/prometheus.yml` passes (promtool is Debian's
  `prometheus` package, which .ci/run installs: a missing promtool fails, never skips);
- every fairlane process of the compose stack is scraped, through DNS service discovery
  of its compose service, on the port that service is started with; NATS through the
  exporter, on the port and nodes the compose files give it;
- every worker service has a health check on its metrics port;
- the dashboard is a valid Grafana dashboard whose every expression parses (promtool
  check rules) and uses only `fairlane_*` series and labels that the metrics modules
  define (read from prometheus_client, not from a list kept here).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace
from urllib.parse import urlsplit

import pytest
import yaml
from prometheus_client.metrics import MetricWrapperBase

from fairlane.tenants import load_tenants

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "compose"
BASE = COMPOSE / "docker-compose.yml"
CLUSTER = COMPOSE / "docker-compose.cluster.yml"
PROMETHEUS = COMPOSE / "prometheus.yml"
DASHBOARD = COMPOSE / "grafana" / "dashboards" / "fairlane.json"
DATASOURCES = COMPOSE / "grafana" / "provisioning" / "datasources" / "prometheus.yml"
PROVIDERS = COMPOSE / "grafana" / "provisioning" / "dashboards" / "fairlane.yml"
FAIRLANE_PROCESSES = ("dispatcher", "streamer", "gpu_worker")
EXPORTER_DEFAULT_PORT = 7777  # prometheus-nats-exporter's -port default

# Grafana variables, replaced for promtool: the values they take with "All" selected.
GRAFANA_VARS = {"$__rate_interval": "1m", "$tenant": ".*", "$tier": ".*"}
# Labels Prometheus attaches to every series (job, instance) or that prometheus.yml's
# relabelling adds (service).
TARGET_LABELS = {"job", "instance", "service"}


# --- helpers -----------------------------------------------------------------------------


def _promtool() -> str:
    path = shutil.which("promtool")
    # CI installs it (.ci/run); a config left unchecked must not pass.
    assert path, "promtool missing: apt-get install prometheus (.ci/run installs it)"
    return path


def _load(path: Path) -> dict:
    data = yaml.safe_load(path.read_text())
    assert isinstance(data, dict), f"{path}: not a YAML mapping"
    return data


def _services(*paths: Path) -> dict[str, dict]:
    """The services of compose files layered in order, merged as compose does for what
    is checked here: mappings (environment, depends_on, healthcheck) key by key, any
    other value (command, image) replaced."""
    merged: dict[str, dict] = {}
    for path in paths:
        for name, svc in (_load(path).get("services") or {}).items():
            into = merged.setdefault(name, {})
            for key, value in (svc or {}).items():
                if isinstance(value, dict) and isinstance(into.get(key), dict):
                    value = {**into[key], **value}
                into[key] = value
    return merged


def _default(value: object) -> str:
    """A compose value with ${VAR:-default} interpolation resolved to its default."""
    return re.sub(r"\$\{[A-Za-z_][A-Za-z0-9_]*:?-([^}]*)\}", r"\1", str(value))


def _env(svc: dict) -> dict[str, str]:
    env = svc.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {k: _default(v) for k, v in env.items()}


def _process(svc: dict) -> str | None:
    """The fairlane process a service runs (`python -m <it>`), or None."""
    cmd = svc.get("command") or []
    if isinstance(cmd, str):
        cmd = cmd.split()
    for i, arg in enumerate(cmd[:-1]):
        if arg == "-m" and cmd[i + 1] in FAIRLANE_PROCESSES:
            return cmd[i + 1]
    return None


def _exporter_args(svc: dict) -> tuple[int, list[str]]:
    """(listening port, monitored URLs) of a prometheus-nats-exporter command."""
    port, urls, cmd = EXPORTER_DEFAULT_PORT, [], list(svc["command"])
    for i, arg in enumerate(cmd):
        if m := re.fullmatch(r"--?(?:p|port)=(\d+)", arg):
            port = int(m.group(1))
        elif arg in ("-p", "-port", "--port"):
            port = int(cmd[i + 1])
        elif not arg.startswith("-") and "://" in arg:
            urls.append(arg.rsplit(",", 1)[-1])  # "<server_id tag>,<url>"
    return port, urls


def _metrics_port(name: str, svc: dict) -> int:
    """The port a service serves its Prometheus text on, as compose starts it."""
    env = _env(svc)
    process = _process(svc)
    if process == "streamer":  # /metrics on its HTTP port, behind the admin key
        return int(env["FAIRLANE_PORT"])
    if process in ("dispatcher", "gpu_worker"):
        assert "FAIRLANE_METRICS_PORT" in env, f"{name}: no FAIRLANE_METRICS_PORT"
        # The default, 127.0.0.1, is unreachable from the prometheus container.
        assert env.get("FAIRLANE_METRICS_HOST") == "0.0.0.0", f"{name}: metrics not on 0.0.0.0"
        return int(env["FAIRLANE_METRICS_PORT"])
    if "prometheus-nats-exporter" in str(svc.get("image", "")):
        return _exporter_args(svc)[0]
    raise AssertionError(f"{name}: serves no metrics that prometheus.yml could scrape")


def _scrape_targets(config: dict) -> dict[str, list[tuple[str, int]]]:
    """{job: [(host or DNS name, port)]} of prometheus.yml's scrape configs."""
    out: dict[str, list[tuple[str, int]]] = {}
    for job in config["scrape_configs"]:
        targets = out.setdefault(job["job_name"], [])
        for sd in job.get("dns_sd_configs") or []:
            assert sd.get("type", "SRV") == "A", f"{job['job_name']}: compose DNS has A records"
            targets += [(n, int(sd["port"])) for n in sd["names"]]
        for sc in job.get("static_configs") or []:
            for t in sc["targets"]:
                host, port = t.rsplit(":", 1)
                targets.append((host, int(port)))
    return out


def _defined_metrics() -> dict[str, tuple[str, frozenset[str]]]:
    """{sample name: (type, label names)} of every series the fairlane code defines.

    Read from the metric objects themselves (the metrics modules, and a `WorkerMetrics`,
    whose series live in its own registry): a counter is exposed as `<name>_total`, a
    histogram as `_bucket` (with `le`), `_sum` and `_count`.
    """
    from dispatcher import metrics as dispatcher_metrics
    from fairlane import ratelimit
    from gpu_worker.metrics import WorkerMetrics
    from streamer import metrics as streamer_metrics

    worker = WorkerMetrics(SimpleNamespace())
    objects = [*vars(dispatcher_metrics).values(), *vars(streamer_metrics).values(),
               *vars(ratelimit).values(), *vars(worker).values(),
               *worker.engine_counters.values()]
    suffixes = {"counter": ("_total", "_created"), "gauge": ("",),
                "histogram": ("_bucket", "_sum", "_count", "_created"),
                "summary": ("", "_sum", "_count", "_created"), "info": ("_info",)}
    out: dict[str, tuple[str, frozenset[str]]] = {}
    for m in objects:
        if not isinstance(m, MetricWrapperBase):
            continue
        family = m.describe()[0]  # public: name (counters without _total) and type
        labels = frozenset(m._labelnames)  # prometheus_client has no public getter
        for suffix in suffixes[family.type]:
            extra = {"le"} if suffix == "_bucket" else set()
            out[family.name + suffix] = (family.type, labels | extra)
    return out


def _targets(dashboard: dict) -> list[tuple[str, dict]]:
    """(panel title, target) of every query of every panel, rows' nested ones included."""
    out = []

    def walk(panels: list[dict]) -> None:
        for p in panels:
            out.extend((p.get("title", ""), t) for t in p.get("targets") or [])
            walk(p.get("panels") or [])

    walk(dashboard["panels"])
    return out


def _exprs(dashboard: dict) -> list[str]:
    exprs = [t["expr"] for _, t in _targets(dashboard)]
    for var in dashboard.get("templating", {}).get("list", []):
        if var.get("type") == "query":
            q = var["query"]
            exprs.append(q["query"] if isinstance(q, dict) else q)
    return exprs


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


@pytest.fixture(scope="module")
def defined() -> dict[str, tuple[str, frozenset[str]]]:
    return _defined_metrics()


# --- Prometheus ------------------------------------------------------------------------


def test_prometheus_config_passes_promtool():
    res = subprocess.run([_promtool(), "check", "config", str(PROMETHEUS)],
                         capture_output=True, text=True, timeout=30)
    assert res.returncode == 0, res.stdout + res.stderr


@pytest.mark.parametrize("files", [(BASE,), (BASE, CLUSTER)], ids=["single", "cluster"])
def test_every_component_is_scraped_on_the_port_compose_starts_it_with(files):
    services = _services(*files)
    targets = _scrape_targets(_load(PROMETHEUS))
    scraped = {host: port for job in targets.values() for host, port in job}
    for host, port in scraped.items():
        if host == "localhost":  # Prometheus itself
            continue
        assert host in services, f"prometheus.yml scrapes {host!r}: no such compose service"
        assert port == _metrics_port(host, services[host]), (
            f"prometheus.yml scrapes {host} on {port}, compose starts it on "
            f"{_metrics_port(host, services[host])}")
    # Every fairlane process, and NATS through the exporter, is scraped.
    for name, svc in services.items():
        if _process(svc) is not None:
            assert name in scraped, f"{name} runs {_process(svc)} but is not scraped"
    assert "nats-exporter" in scraped
    assert ("localhost", 9090) in targets["prometheus"]


def test_streamer_scrape_sends_an_admin_key_of_the_default_tenants_file():
    job = next(j for j in _load(PROMETHEUS)["scrape_configs"]
               if any("streamer" in sd["names"] for sd in j.get("dns_sd_configs") or []))
    key = job["authorization"]["credentials"]
    env = _env(_services(BASE)["streamer"])
    tenants_file = env["FAIRLANE_TENANTS_FILE"].rsplit("/", 1)[-1]  # /etc/fairlane/<file>
    tenants = load_tenants(ROOT / "fairlane" / tenants_file)  # TENANTS_DIR's default
    assert tenants.is_admin_key(key), "the streamer's /metrics would answer 401"
    assert tenants.lookup_key(key) is None  # an admin key, not a tenant's


@pytest.mark.parametrize("files", [(BASE,), (BASE, CLUSTER)], ids=["single", "cluster"])
def test_nats_exporter_watches_every_nats_node_on_its_monitoring_port(files):
    services = _services(*files)
    nodes = {}
    for name, svc in services.items():
        cmd = svc.get("command") or []
        if cmd and cmd[0] == "nats-server":
            nodes[name] = int(cmd[cmd.index("-m") + 1])
    assert nodes
    exporter = services["nats-exporter"]
    assert _default(exporter["image"]).split(":")[0].endswith("natsio/prometheus-nats-exporter")
    _, urls = _exporter_args(exporter)
    watched = {urlsplit(u).hostname: urlsplit(u).port for u in urls}
    assert watched == nodes, f"exporter watches {watched}, the NATS nodes are {nodes}"
    assert {"-varz", "-connz"} <= set(exporter["command"])
    assert any(a.startswith("-jsz=") for a in exporter["command"])


# --- compose ----------------------------------------------------------------------------


@pytest.mark.parametrize("files", [(BASE,), (BASE, CLUSTER)], ids=["single", "cluster"])
def test_every_worker_service_has_a_health_check_on_its_metrics_port(files):
    services = _services(*files)
    workers = {n: s for n, s in services.items() if _process(s) == "gpu_worker"}
    assert {"gpu-worker", "sim-worker"} <= set(workers)
    for name, svc in workers.items():
        check = svc.get("healthcheck")
        assert check and not check.get("disable"), f"{name}: no health check"
        test = check["test"]
        assert test[0] in ("CMD", "CMD-SHELL"), test
        m = re.search(r"http://127\.0\.0\.1:(\d+)/metrics", " ".join(test))
        assert m, f"{name}: health check reads no /metrics: {test}"
        assert int(m.group(1)) == _metrics_port(name, svc), name
        # The image's own python (python:3.11-slim, vLLM's image): no curl needed.
        assert test[1] in ("python", "python3"), test
        for key in ("interval", "timeout", "start_period"):
            assert re.fullmatch(r"\d+(ms|s|m)", _default(check[key])), (name, key, check[key])


def test_compose_files_are_valid_and_observability_services_are_profiled():
    base, cluster = _load(BASE), _load(CLUSTER)
    services = base["services"]
    # The overlay only adds nodes or changes services the main file defines.
    for name in cluster["services"]:
        assert name in services or name.startswith("nats-"), name
    for name in ("nats-exporter", "prometheus", "grafana"):
        assert services[name].get("profiles") == ["metrics"], name
        for dep in services[name].get("depends_on") or []:
            assert dep in services, (name, dep)
    # Every bind mount of the observability services exists in the repository.
    for name in ("prometheus", "grafana"):
        for vol in services[name]["volumes"]:
            if isinstance(vol, dict) and vol["type"] == "bind":
                assert (COMPOSE / vol["source"]).exists(), (name, vol["source"])
    for volume in ("prometheus-data", "grafana-data"):
        assert volume in base["volumes"]


# --- Grafana ----------------------------------------------------------------------------


def test_grafana_provisioning_points_at_the_prometheus_service_and_the_dashboard(dashboard):
    services = _services(BASE)
    (source,) = _load(DATASOURCES)["datasources"]
    url = urlsplit(source["url"])
    assert source["type"] == "prometheus"
    assert url.hostname == "prometheus" and url.hostname in services
    assert any(str(p).endswith(f":{url.port}") for p in services["prometheus"]["ports"])
    # timeInterval = the scrape interval ($__rate_interval is computed from it).
    assert source["jsonData"]["timeInterval"] == _load(PROMETHEUS)["global"]["scrape_interval"]

    grafana = services["grafana"]
    mounts = {v["source"]: v["target"] for v in grafana["volumes"]
              if isinstance(v, dict) and v["type"] == "bind"}
    assert mounts["./grafana/provisioning"] == "/etc/grafana/provisioning"
    (provider,) = _load(PROVIDERS)["providers"]
    assert provider["type"] == "file"
    assert provider["options"]["path"] == mounts["./grafana/dashboards"]
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home == f"{mounts['./grafana/dashboards']}/{DASHBOARD.name}"
    # Every panel and variable queries the provisioned datasource.
    uids = {t.get("datasource", {}).get("uid") for _, t in _targets(dashboard)}
    uids |= {p["datasource"]["uid"] for p in dashboard["panels"] if p["type"] != "row"}
    uids |= {v["datasource"]["uid"] for v in dashboard["templating"]["list"]}
    assert uids == {source["uid"]}


def test_dashboard_is_a_valid_grafana_dashboard(dashboard):
    assert dashboard["uid"] and len(dashboard["uid"]) <= 40
    assert dashboard["title"]
    assert isinstance(dashboard["schemaVersion"], int)
    panels = dashboard["panels"]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    graphs = [p for p in panels if p["type"] != "row"]
    assert len(graphs) >= 20
    for p in graphs:
        assert p["title"] and p["type"] in ("timeseries", "stat"), p.get("title")
        pos = p["gridPos"]
        assert pos["w"] > 0 and pos["h"] > 0 and pos["x"] + pos["w"] <= 24, p["title"]
        assert p["targets"], f"{p['title']}: no query"
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs)), p["title"]
        assert all(t["expr"].strip() for t in p["targets"]), p["title"]
    # No two panels overlap (Grafana would shift them, silently).
    cells = set()
    for p in panels:
        pos = p["gridPos"]
        mine = {(x, y) for x in range(pos["x"], pos["x"] + pos["w"])
                for y in range(pos["y"], pos["y"] + pos["h"])}
        assert not cells & mine, f"{p['title']} overlaps another panel"
        cells |= mine


def test_dashboard_expressions_parse(dashboard, tmp_path):
    """Every query is valid PromQL: promtool parses them as recording rules."""
    rules = []
    for i, expr in enumerate(e for e in _exprs(dashboard) if not e.startswith("label_values")):
        for var, value in GRAFANA_VARS.items():
            expr = expr.replace(var, value)
        assert "$" not in expr, f"unknown dashboard variable in {expr}"
        rules.append({"record": f"dashboard:query_{i}", "expr": expr})
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    res = subprocess.run([_promtool(), "check", "rules", str(path)],
                         capture_output=True, text=True, timeout=30)
    assert res.returncode == 0, res.stdout + res.stderr


def test_dashboard_uses_only_metrics_and_labels_the_code_defines(dashboard, defined):
    # The reader itself works: a known series of each process, with its labels.
    assert defined["fairlane_dispatcher_queue_wait_seconds_bucket"][1] == {"tier", "le"}
    assert defined["fairlane_worker_completion_tokens_total"][1] == {"tenant"}
    assert defined["fairlane_streamer_requests_total"][1] == {"tenant", "endpoint", "outcome"}

    for expr in _exprs(dashboard):
        used = re.findall(r"\b(fairlane_[A-Za-z0-9_]+)\s*(\{[^}]*\})?", expr)
        for name, selector in used:
            assert name in defined, f"{name} is defined nowhere in the code ({expr})"
            labels = set(re.findall(r"(\w+)\s*(?:=~|!~|!=|=)\s*\"", selector))
            assert labels <= defined[name][1], f"{name} has no label {labels - defined[name][1]}"
        for m in re.finditer(r"\b(?:rate|irate|increase)\(\s*(fairlane_\w+)", expr):
            assert defined[m.group(1)][0] in ("counter", "histogram"), f"rate of a gauge: {expr}"
        # Grouping labels: those of the fairlane series in the expression (where it has
        # no others, e.g. the exporter's, whose labels are not known here).
        if used and not re.search(r"\b(?:gnatsd|jetstream)_\w+|\bup\b", expr):
            allowed = TARGET_LABELS.union(*(defined[n][1] for n, _ in used))
            for m in re.finditer(
                    r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)", expr):
                grouped = {x.strip() for x in m.group(1).split(",") if x.strip()}
                assert grouped <= allowed, f"no such label {grouped - allowed} in {expr}"


def test_dashboard_covers_throughput_queues_latency_rejections_workers_and_nats(dashboard):
    exprs = _exprs(dashboard)
    text = "\n".join(exprs)
    for name in (
        # throughput per tier and tenant
        "fairlane_worker_completion_tokens_total", "fairlane_worker_prompt_tokens_total",
        "fairlane_dispatcher_dispatched_cost_total",
        # queue depth and in-flight per tenant
        "fairlane_dispatcher_queue_depth", "fairlane_dispatcher_in_flight",
        # rejections and preemptions
        "fairlane_dispatcher_rejected_total", "fairlane_streamer_requests_total",
        "fairlane_dispatcher_preemptions_total",
        # workers
        "fairlane_worker_running_seqs", "fairlane_worker_waiting_seqs",
        "fairlane_worker_kv_tokens_used", "fairlane_worker_kv_tokens_capacity",
    ):
        assert re.search(rf"\b{name}\b", text), f"no panel shows {name}"
    for hist in ("fairlane_dispatcher_queue_wait_seconds", "fairlane_streamer_ttft_seconds",
                 "fairlane_worker_ttft_seconds"):
        for q in ("0.5", "0.99"):
            assert any(e.startswith(f"histogram_quantile({q},") and f"{hist}_bucket" in e
                       for e in exprs), f"no p{q} of {hist}"
    assert 'by (tenant)' in text and 'by (tier)' in text
    assert re.search(r"\bgnatsd_varz_\w+", text) and re.search(r"\bjetstream_\w+", text)
