"""fast.server.replicas: two CPU replicas of fast.serve behind Ray Serve on this machine (skipped where Ray Serve is not
installed: the `replicas` extra)."""

import concurrent.futures

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

from fast.server.replicas import application  # noqa: E402
from tests.e2e.server import free_port  # noqa: E402
from tests.helpers import SHIPPED  # noqa: E402


def test_two_replicas_serve_requests_and_report_health():
    port = free_port()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(application(SHIPPED, 2, slots=2, threads=1, cpus_per_replica=0.5), route_prefix="/")
        url = f"http://127.0.0.1:{port}"
        status = serve.status().applications["default"].deployments["fast-serve"]
        assert status.replica_states.get("RUNNING") == 2
        for _ in range(100):  # each replica loads its model on its engine thread
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                break
        body = {"prompt": "once upon a time", "max_tokens": 8, "temperature": 0}
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            answers = list(pool.map(lambda _: httpx.post(url + "/v1/completions", json=body, timeout=120), range(6)))
        assert all(a.status_code == 200 for a in answers), [a.text for a in answers]
        assert len({a.json()["choices"][0]["text"] for a in answers}) == 1  # greedy: the same text from either replica
        assert "powerinfer_py:requests_total" in httpx.get(url + "/metrics", timeout=10).text
    finally:
        serve.shutdown()
        ray.shutdown()
