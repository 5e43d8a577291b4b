"""The `meshrl` command. Each subcommand imports what it needs only once it is chosen."""

from __future__ import annotations

import sys

USAGE = """usage: meshrl COMMAND [ARGS]

commands:
  demo                                       the main job: a tiny model learns arithmetic by GRPO
  demo vlm [--json]                          a tiny vision-language model learns to read pictures
  run RECIPE [--devices N] [key=value ...]   run a recipe on this host (Ctrl-C stops it)
  launch RECIPE [key=value ...]              one launcher of a multi-host run (under torchrun -m meshrl)
  models NAME [--out DIR]                    a real pretrained model as an HF folder (smollm2-135m)
  eval RECIPE [--model PATH] [key=value ...]  held-out accuracy, pass@k, reward per function (JSON)
  sft --model PATH --data ROWS --out PATH    supervised fine-tuning on chat or prompt/completion rows
      [section.field=value ...]              the trainer's sections: optim.lr=3e-3 lora.rank=8
  status [RUN_DIR] [--json]                  services, queue, rings and weight version of a run
  scale RUN_DIR GROUP=N [GROUP=N ...]        change a running run's replica counts (inference=3)
  join ADDRESS|RUN_DIR [GROUP=N ...]         this host joins a running run with replicas (--devices N)
  dashboard [RUN_DIR] [--host H] [--port P]  a run's charts, services and samples in the browser
  queue serve [...]                          run the data plane's controller / storage server
"""


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    cmd, rest = (args[0], args[1:]) if args else ("", [])
    if cmd == "run":
        from meshrl.runtime.run import main as run

        raise SystemExit(run(rest))
    if cmd == "launch":
        from meshrl.runtime.launch import main as launch

        launch(rest)
        return
    if cmd == "demo":
        from meshrl.commands.demo import main as demo

        raise SystemExit(demo(rest))
    if cmd == "models":
        from meshrl.models.fetch import main as models

        raise SystemExit(models(rest))
    if cmd == "eval":
        from meshrl.commands.eval import main as evaluate

        raise SystemExit(evaluate(rest))
    if cmd == "sft":
        from meshrl.commands.sft import main as sft

        raise SystemExit(sft(rest))
    if cmd == "status":
        from meshrl.observe.status import main as status

        raise SystemExit(status(rest))
    if cmd == "scale":
        from meshrl.commands.scale import main as scale

        raise SystemExit(scale(rest))
    if cmd == "join":
        from meshrl.runtime.joined import main as join

        raise SystemExit(join(rest))
    if cmd == "dashboard":
        from meshrl.observe.dashboard import main as dashboard

        raise SystemExit(dashboard(rest))
    if cmd == "queue" and rest[:1] == ["serve"]:
        from meshrl.dataplane.serve import main as serve

        serve(rest[1:])
        return
    print(USAGE, file=sys.stderr)
    raise SystemExit(2 if cmd not in ("-h", "--help", "help") else 0)


if __name__ == "__main__":
    main()
