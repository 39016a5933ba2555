"""`python -m fast.server.replicas [MODEL] -r N`: N whole replicas of `fast.serve` behind Ray Serve's router (the `replicas`
extra), on one machine or a Ray cluster.

PowerInfer's speed comes from locality inside one box (hot neurons on its GPU, cold ones in the same host's memory),
so a model is not split across machines: each replica is a complete server (its engine thread, slots and queue, one
GPU and its CPU), and Ray Serve spreads requests over the replicas (data parallelism). A replica's routes are
fast.serve's, built on the replica (`serve.ingress` with a builder) once its model is loaded, since Ray's router does
not ask /health; Ray's health check asks the replica's scheduler (`check_health`), and /health and /metrics answer
per replica for an outside router.
"""

import os
import sys
from pathlib import Path

import click

from ref.common.cli import resolve_model, user_errors
from ref.common.errors import UserError

_replica: dict = {}  # this replica process's scheduler (each Ray Serve replica is its own process)


def build_app(path: str, slots: int, ctx_size: int, batch_size: int, max_queue: int, threads: int | None,
              device: str, dense: bool, alias: str | None, api_key: str | None, host: str = "127.0.0.1"):
    """fast.serve's application over a scheduler that loads the model on its engine thread (run on the replica)."""
    from ref.common.artifacts import default_predictors
    from fast.server.app import serving

    model = Path(path)
    server, app = serving(model, slots, ctx_size, batch_size, max_queue, alias, api_key, host, device=device,
                          predictors=default_predictors(model, dense=dense), threads=threads)
    scheduler = _replica["scheduler"] = server.scheduler
    # Ray's router sends requests to a replica once it is built, without asking /health: build it loaded.
    while not scheduler.ready.wait(0.1):
        if scheduler.failed is not None:
            raise scheduler.failed
    return app


class Replica:
    """One fast.serve process; Ray restarts it when `check_health` raises. At module level, so that Ray pickles it by
    reference and the replica reads its own process's `_replica`."""

    def check_health(self):
        s = _replica.get("scheduler")
        if s is not None and s.failed is not None:
            raise RuntimeError(f"the model failed to load: {s.failed}")


def application(path: Path, replicas: int, slots: int = 4, ctx_size: int = 0, batch_size: int = 512,
                max_queue: int = 64, threads: int | None = None, device: str = "cpu", dense: bool = False,
                alias: str | None = None, api_key: str | None = None, cpus_per_replica: float | None = None,
                host: str = "127.0.0.1"):
    """A Ray Serve application of `replicas` fast.serve replicas (serve.run it)."""
    from ray import serve

    def build():  # a plain function: Ray Serve takes any other callable for the ASGI app itself
        return build_app(str(path), slots, ctx_size, batch_size, max_queue, threads, device, dense, alias, api_key,
                         host)
    options = {"num_cpus": cpus_per_replica if cpus_per_replica is not None else (threads or 1)}
    if device != "cpu":
        options["num_gpus"] = 1
    deployment = serve.deployment(name="fast-serve", num_replicas=replicas, ray_actor_options=options,
                                  max_ongoing_requests=slots + max_queue)(serve.ingress(build)(Replica))
    return deployment.bind()


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("model_dir", required=False, type=click.Path(path_type=Path))
@click.option("-m", "--model", type=click.Path(path_type=Path), default=None, help="Same as MODEL_DIR.")
@click.option("-r", "--replicas", type=int, default=2, show_default=True, help="Whole fast.serve replicas.")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=int, default=8000, show_default=True, help="Ray Serve's HTTP proxy.")
@click.option("-np", "--parallel", "slots", type=int, default=4, show_default=True, help="Slots per replica.")
@click.option("-c", "--ctx-size", type=int, default=0, show_default=True)
@click.option("-t", "--threads", type=int, default=1, show_default=True, help="CPU threads per replica.")
@click.option("--device", type=click.Choice(["cpu", "gpu", "hybrid"]), default="cpu", show_default=True,
              help="gpu/hybrid: one GPU per replica.")
@click.option("--dense", is_flag=True)
@click.option("--address", default=None, help="A Ray cluster to join [default: start one on this machine].")
@click.option("-a", "--alias", default=None)
@click.option("--api-key", default=None)
@user_errors
def main(model_dir, model, replicas, host, port, slots, ctx_size, threads, device, dense, address, alias, api_key):
    """Serve MODEL_DIR with N fast.serve replicas behind Ray Serve."""
    try:
        import ray
        from ray import serve
    except ImportError:
        raise UserError("fast.server.replicas needs Ray Serve: pip install -e '.[replicas]'") from None
    if replicas < 1:
        raise UserError(f"-r/--replicas must be >= 1, got {replicas}")
    path = resolve_model(model_dir, model).resolve()
    ray.init(address=address, include_dashboard=False, runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join(sys.path)}})
    serve.start(http_options={"host": host, "port": port})
    serve.run(application(path, replicas, slots, ctx_size, threads=threads, device=device, dense=dense,
                          alias=alias, api_key=api_key, host=host), route_prefix="/", blocking=True)


if __name__ == "__main__":
    main()
