"""What one decode step runs, read from the compiled loops' optimized HLO (libtpu on this CPU
machine, abstract TPU devices: no TPU needed): the collectives of each loop body by scope
(draft / verify / accept) and the instructions that copy a cache-sized buffer per step
(pads and relayouts; whole-cache VMEM round trips as copy-starts).

DFLASH_KV_UPDATE=pallas compiles the cache writes as the Pallas DMA kernel
(dflash_jax/models/attention.py).

    python benchmarks/loop_hlo.py --model=qwen3_8b --topology=v5e:2x4 --mesh=tensor=8 \\
        --context=4096 --max_new_tokens=256 --json_out=benchmarks/results/loop_hlo/X.json

The JSON records the command and the commit it was made with.

Committed results: `benchmarks/results/loop_hlo/*.json`, each with its command
(`benchmarks/results/loop_hlo/README.md`).
"""

from __future__ import annotations

import collections
import json
import os

from absl import flags

from dflash_jax.support import cli

FLAGS = flags.FLAGS


def define_flags():
    flags.DEFINE_string("model", "qwen3_8b", "Dry-run preset (qwen3_8b, qwen3_4b, small, tiny...).")
    flags.DEFINE_string("topology", "v5e:2x4", "TPU topology (abstract devices).")
    flags.DEFINE_string("mesh", "tensor=8", "Device mesh.")
    flags.DEFINE_integer("context", 4096, "Prompt tokens.", lower_bound=1)
    flags.DEFINE_integer("max_new_tokens", 256, "New tokens.", lower_bound=1)
    flags.DEFINE_string("hlo_dir", None, "Keep the HLO here (default: a temporary directory).")
    flags.DEFINE_string("json_out", None, "Write the findings as JSON here.")


def _scope(s: str) -> str:
    parts = s.split("/")
    return parts[3] if len(parts) > 3 and parts[2] == "body" else "other"


def main(argv):
    import tempfile

    from dflash_jax import dry_run
    from dflash_jax.decoding.programs import buffer_sizes
    from dflash_jax.dry_run import hlo

    if len(argv) > 1:
        raise ValueError(f"unexpected arguments: {' '.join(argv[1:])}")
    devices, chip = dry_run.topology_devices(FLAGS.topology)
    out_dir = FLAGS.hlo_dir or tempfile.mkdtemp(prefix="loop_hlo-")
    r = dry_run.dry_run_infer(
        FLAGS.model,
        FLAGS.mesh,
        batch=1,
        context=FLAGS.context,
        max_new_tokens=FLAGS.max_new_tokens,
        devices=devices,
        chip=chip,
        attention=("pallas",),
        step_costs=False,
        only=("dflash_decode", "ar_decode"),
        hlo_dir=out_dir,
    )
    found = {}
    for name, bs in (("dflash_decode", r["settings"]["block_size"]), ("ar_decode", 1)):
        text = open(os.path.join(out_dir, f"{name}.hlo")).read()
        cap = buffer_sizes(FLAGS.context, FLAGS.max_new_tokens, bs)[2]
        coll = hlo.loop_collectives(text)
        by = collections.Counter(f"{c['op']} {_scope(c['scope'])}" for c in coll)
        min_elems = cap * 128  # one KV head of head_dim >= 128 per chip at least
        pads = hlo.cache_sized_copies(
            text, cap, min_elems, ("pad", "copy", "transpose", "concatenate", "reshape")
        )
        trips = hlo.cache_sized_copies(text, cap, min_elems, ("copy-start",))
        found[name] = {
            "capacity": cap,
            "collectives": len(coll),
            "collectives_by_scope": dict(sorted(by.items())),
            "cache_pads_or_relayouts": pads,
            "cache_vmem_round_trips": len(trips),
        }
        print(
            f"{name}: capacity {cap}, {len(coll)} collectives per step "
            f"({', '.join(f'{k}: {v}' for k, v in sorted(by.items()))}); "
            f"cache pads/relayouts per step: {len(pads)}; whole-cache VMEM round trips "
            f"(copy-start): {len(trips)}"
        )
    from dflash_jax.models import attention

    kv_env = "" if attention.KV_UPDATE == "xla" else f"DFLASH_KV_UPDATE={attention.KV_UPDATE} "
    print(f"cache writes: {attention.KV_UPDATE} (DFLASH_KV_UPDATE)")
    ratio = found["dflash_decode"]["collectives"] / max(1, found["ar_decode"]["collectives"])
    print(f"DFlash / AR collectives per step: {ratio:.2f}x")
    if FLAGS.json_out:
        from dflash_jax.support import provenance

        prov = provenance.record()
        with open(FLAGS.json_out, "w") as f:
            json.dump(
                {
                    **prov,
                    "command": kv_env + prov["command"],
                    "model": FLAGS.model,
                    "topology": FLAGS.topology,
                    "mesh": FLAGS.mesh,
                    "context": FLAGS.context,
                    "max_new_tokens": FLAGS.max_new_tokens,
                    "programs": found,
                    "dflash_over_ar_collectives": ratio,
                },
                f,
                indent=1,
            )
        print(f"wrote {FLAGS.json_out}")


if __name__ == "__main__":
    define_flags()
    cli.run(main)
