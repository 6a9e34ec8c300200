"""What infer.py runs once its flags are checked (`run_and_report`): prompt items encoded with
the target's tokenizer, everything a run would refuse checked from the config.json files
before any weight is read (`check_before_loading`), the models loaded, the batch runner, and
the printed report."""

from __future__ import annotations

import os
import sys
import warnings
from typing import List, Optional, Sequence

from dflash_jax.drafters import registry
from dflash_jax.frontend import infer_flags, textgen
from dflash_jax.frontend.batch_runner import BatchReport, run_prompts
from dflash_jax.frontend.records import model_identity, read_done, run_settings
from dflash_jax.support import checks, interrupts


def check_before_loading(
    target_dir: str,
    drafter_dir: Optional[str],
    prompts: Sequence[Sequence[int]],
    gen_kw: dict,
    *,
    dtype: str = "float32",
    param_dtype: Optional[str] = None,
    attention_impl: str = "xla",
    mesh=None,
    quantize: Optional[str] = None,
    quantize_lm_head: bool = False,
    labels: Optional[Sequence[str]] = None,
) -> None:
    """What `generate` would refuse, checked from the config.json files alone (no weights are
    read): the pair's fit, the context length (prompt + max_new_tokens against
    max_position_embeddings), block size and denoise steps against the drafter's, stop ids in
    the vocabulary, the seed and sampling, and the attention implementation on `mesh`'s
    devices (the default backend's without one), the target's quantization_config and the
    `quantize` request (an LM head that is tied cannot be int8). Raises ValueError (one line)."""
    from dflash_jax.decoding.request import Request
    from dflash_jax.models import attention, checkpoint
    from dflash_jax.models.config import ModelConfig
    from dflash_jax.models.safetensors_io import CheckpointError

    source = os.path.join(target_dir, "config.json")
    try:
        tcfg = ModelConfig.from_hf(
            checkpoint.read_config(target_dir),
            dtype=dtype,
            param_dtype=param_dtype,
            source=source,
        )
    except CheckpointError:
        raise
    except ValueError as e:
        raise CheckpointError(str(e)) from e
    from dflash_jax.models.quantization import check_quantize

    if check_quantize(quantize) is not None or quantize_lm_head:
        if tcfg.quantization is None and quantize is None:
            raise ValueError("quantize_lm_head needs quantize='int8'")
        try:
            tcfg = tcfg.replace(
                quantization="int8", quantize_lm_head=quantize_lm_head or tcfg.quantize_lm_head
            )
        except ValueError as e:
            raise ValueError(f"{source}: {e}") from None
    kind = registry.for_spec(drafter_dir)
    dcfg = kind.read_config(drafter_dir, tcfg, dtype=dtype) if drafter_dir else None
    try:
        attention.for_devices(attention_impl, mesh)
    except ValueError as e:
        raise ValueError(f"attention_impl {attention_impl!r}: {e}") from None
    settings = {k: v for k, v in gen_kw.items() if k in Request.SETTINGS}
    with warnings.catch_warnings():  # generate itself warns (block_size past the drafter's)
        warnings.simplefilter("ignore")
        Request.build(tcfg, dcfg, prompts, gen_kw.get("max_new_tokens"), labels=labels, **settings)
    if mesh is not None:
        from dflash_jax.parallel import sharding

        sharding.check_expert_axis(mesh.shape.get("expert", 1), tcfg.num_experts)


@checks.reading_once()  # each config.json off the disk once: the checks, then the loaders
def run_and_report(
    target_dir: str,
    drafter_dir: Optional[str],
    items: Sequence[dict],
    *,
    labels: Optional[Sequence[str]] = None,
    chat_template: bool = True,
    dtype: str = "float32",
    param_dtype: Optional[str] = None,
    quantize: Optional[str] = None,
    quantize_lm_head: bool = False,
    scan_layers: bool = False,
    attention_impl: str = "xla",
    mesh: Optional[str] = None,
    batch_size: Optional[int] = None,
    out_path: Optional[str] = None,
    resume: bool = False,
    compare_ar: bool = False,
    profile_dir: Optional[str] = None,
    stream: Optional[bool] = None,
    target_name: Optional[str] = None,
    drafter_name: Optional[str] = None,
    **gen_kw,
) -> Optional[BatchReport]:
    """What infer.py runs once its flags are checked: prompt items (`prompting`) encoded with
    `target_dir`'s tokenizer, the models loaded, `run_prompts`, and `report.print_run` on stdout.

    mesh: a `sharding.parse_mesh` spec; "" / None: one device, or every device with several
    processes. quantize / quantize_lm_head / scan_layers: `load_target`'s. batch_size: default
    8 for several prompts, else 1. stream: print a single prompt's completion as it is
    committed, an extra untimed run (`_stream_callback`). target_name / drafter_name: what the
    user called the models (hub ids), printed and matched on resume. gen_kw: `generate`'s
    max_new_tokens and settings (stop ids: the target directory's).

    Returns the report, or None when stopped by Ctrl-C during generation (finished batches are
    in `out_path`, as a line on stderr says). Refused before any model is loaded (ValueError,
    one line): an `out_path` that is a file of a model directory, what `generate` would refuse
    (`check_before_loading`), a `resume` file of other prompts or settings (`resume_settings`).
    """
    from dflash_jax.frontend import report
    from dflash_jax.parallel import distributed, sharding

    target_name = target_dir if target_name is None else target_name
    drafter_name = drafter_dir if drafter_name is None else drafter_name
    infer_flags.output_not_input(
        out_path, "--json_out", dirs={"--target": target_dir, "--drafter": drafter_dir}
    )
    if mesh or distributed.is_multiprocess():
        mesh = sharding.make_mesh(**sharding.parse_mesh(mesh or ""))
    else:
        mesh = None
    text = textgen.load_text(target_dir)  # config, tokenizer, stop ids, vocabulary size
    kind = registry.for_spec(drafter_dir)  # --drafter=prompt_lookup[:N-M], a directory
    if drafter_dir:  # its config.json checked against the target's, before the prompts
        kind.read_config(drafter_dir, text.config)
    tok = text.tokenizer
    prompts = text.encode(items, chat_template, labels=labels)
    batch_size = batch_size or (8 if len(prompts) > 1 else 1)
    gen_kw = dict(gen_kw, stop_token_ids=text.stop_token_ids, mesh=mesh)
    model_kw = dict(dtype=dtype, param_dtype=param_dtype, quantize=quantize)
    model_kw.update(quantize_lm_head=quantize_lm_head)
    check_before_loading(
        target_dir, drafter_dir, prompts, gen_kw, attention_impl=attention_impl, mesh=mesh,
        labels=labels, **model_kw,
    )  # fmt: skip
    extra_settings = resume_settings(
        target_name, drafter_name, chat_template=chat_template, scan_layers=scan_layers,
        **model_kw,
    )  # fmt: skip
    if resume:  # a file of other prompts or settings is refused before any compute
        read_done(
            out_path,
            prompts,
            run_settings(gen_kw, batch_size, drafter_dir is not None, extra_settings),
        )

    target, drafter = _load_models(
        target_dir, drafter_dir, kind, (target_name, drafter_name),
        attention_impl=attention_impl, scan_layers=scan_layers, **model_kw,
    )  # fmt: skip
    callback = _stream_callback(stream, mesh, tok, prompts)
    # Batches grouped by length; the first is run once untimed (compiles both programs).
    rep = _run_interruptible(
        target, drafter, prompts, out_path, callback, batch_size=batch_size, resume=resume,
        tokenizer=tok, compare_ar=compare_ar, profile_dir=profile_dir,
        extra_settings=extra_settings, **gen_kw,
    )  # fmt: skip
    if rep is None:
        return None
    report.print_run(
        rep,
        prompts,
        tokenizer=tok,
        batch_size=batch_size,
        with_drafter=drafter is not None,
        json_out=out_path,
        profile_dir=profile_dir,
        sampled=float(gen_kw.get("temperature") or 0.0) > 0,
    )
    return rep


def resume_settings(
    target_name,
    drafter_name,
    *,
    dtype,
    param_dtype,
    chat_template,
    quantize=None,
    quantize_lm_head=False,
    scan_layers=False,
) -> dict:
    """What a resumed file must also match besides the generation settings: the models (by
    `model_identity`), their dtypes, the chat template, and quantization and the scanned
    layers when asked for (absent otherwise, so files of earlier runs still resume)."""
    out = {
        "target": model_identity(target_name),
        "drafter": model_identity(drafter_name),
        "dtype": dtype,
        "param_dtype": param_dtype,
        "chat_template": chat_template,
    }
    if quantize or quantize_lm_head:
        out.update(quantize=quantize, quantize_lm_head=quantize_lm_head)
    if scan_layers:  # the same model; float32 sums in another order, so resumed runs match it
        out.update(scan_layers=True)
    return out


def _run_interruptible(
    target, drafter, prompts, out_path, callback, **run_kw
) -> Optional[BatchReport]:
    """`run_prompts`, or None when Ctrl-C stops it (a line on stderr says which batches are in
    `out_path`); from the first batch written on, Ctrl-C keeps what is in the file."""
    from dflash_jax.frontend import report

    finished: List[int] = []

    def on_batch(b, recs):
        finished.append(b)
        if out_path:  # a batch is in the file: Ctrl-C from now on keeps it (KeyboardInterrupt)
            interrupts.release()

    try:
        rep = run_prompts(
            target,
            drafter,
            prompts,
            out_path=out_path,
            stream_callback=callback,
            on_batch=on_batch,
            **run_kw,
        )
        if callback is not None:
            print("\n")
    except KeyboardInterrupt:
        note = report.interrupted_line(out_path, len(finished))
        if note:
            print(note, file=sys.stderr)
        return None
    return rep


def _load_models(target_dir, drafter_dir, kind, names, **target_kw):
    """(target, drafter or None) loaded (`load_target`'s keywords), and the line naming them
    (`names`: what the user called them) printed."""
    import jax

    from dflash_jax.frontend import report
    from dflash_jax.models.target import load_target

    target = load_target(target_dir, **target_kw)
    drafter = kind.load(drafter_dir, target) if drafter_dir else None
    print(
        report.model_line(names[0], target.config, names[1], jax.default_backend()),
        flush=True,
    )
    return target, drafter


def _stream_callback(stream, mesh, tokenizer, prompts):
    """The callback printing a single prompt's completion as it is committed (stream None:
    when stdout is a terminal), or None: several prompts, no tokenizer, or a mesh (the
    callback runs on one device, a host callback per step)."""
    from dflash_jax.frontend import report

    stream = sys.stdout.isatty() if stream is None else stream
    if stream and mesh is None and tokenizer is not None and len(prompts) == 1:
        return report.stream_printer(tokenizer, prompts[0])
    return None
