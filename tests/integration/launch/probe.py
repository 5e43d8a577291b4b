"""A service that reports what its process looks like (for the zygote's tests), then ends the run."""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
from dataclasses import dataclass

from meshrl.planning.recipe import ServiceConfig
from meshrl.runtime.service import Service


@dataclass(frozen=True, kw_only=True)
class ProbeConfig(ServiceConfig):
    service = "tests.integration.launch.probe:Probe"
    out: str = ""


class Probe(Service):
    def run(self) -> None:
        import torch

        cfg = self.ctx.config
        assert isinstance(cfg, ProbeConfig)
        print("probe on stdout")
        print("probe on stderr", file=sys.stderr)
        logging.getLogger("probe").info("probe through logging")
        report = {
            "rand": torch.rand(4).tolist(),
            "numpy_rand": __import__("numpy").random.rand(2).tolist(),
            "pid": os.getpid(),
            "ppid": os.getppid(),
            "sid": os.getsid(0),
            "pgid": os.getpgid(0),
            "sigint_default": signal.getsignal(signal.SIGINT) is signal.default_int_handler,
            "sigchld_default": signal.getsignal(signal.SIGCHLD) == signal.SIG_DFL,
            "env": dict(os.environ),
            "argv0": sys.argv[0],
            "root_handlers": len(logging.getLogger().handlers),
        }
        with open(f"{cfg.out}.{self.ctx.name}", "w") as f:
            json.dump(report, f)
        self.finish_run()
