"""The trainer's default config: every key `dflash_jax.training.train_and_evaluate` reads.

The defaults are the DFlash paper's drafter recipe (appendix A.1): 5 drafter layers and 5 taps,
block 16, 512 random anchors, gamma 7, CE loss on fully masked blocks, sequences of 3072 tokens,
AdamW lr 6e-4 with 4% warmup and a cosine decay, global-norm clip 1.0, no weight decay, 6
epochs. Every other file in `configs/` starts from `get_config()` and sets only what differs;
`dflash_jax.training.config_checks` checks a config's keys against it (a typo is an error, not an ignored
setting).

    python train.py --config=configs/default.py --workdir=DIR --config.target_path=...
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
    """Every key the trainer reads, with the paper's drafter recipe as defaults."""
    c = ml_collections.ConfigDict()
    _run_settings(c)
    _models(c)
    _recipe(c)
    _data(c)
    _optimization(c)
    _loop(c)
    return c


def _run_settings(c: ml_collections.ConfigDict) -> None:
    """The run: mode, seed, device mesh, compute dtype."""
    c.mode = "drafter"  # "drafter" | "target"
    c.seed = 0
    # Device mesh: "" = data parallel over all local devices (parameters replicated), or a
    # dflash_jax.parallel.sharding spec ("fsdp=8", "data=2,fsdp=4", "fsdp=4,tensor=2"; -1 = the rest;
    # a mixture-of-experts target also "expert=N", N dividing its experts: "data=2,expert=2,fsdp=2").
    c.mesh = ""
    c.dtype = "float32"  # compute dtype ("bfloat16" on accelerators)


def _models(c: ml_collections.ConfigDict) -> None:
    """The target (a directory, or a fresh model), the tokenizer, and the drafter."""
    # Target: a HF directory, or (empty path) a random/fresh model described by target_model.
    c.target_path = ""
    c.target_model = ml_collections.ConfigDict(
        dict(
            vocab_size=0,  # 0: the tokenizer's vocabulary size
            hidden_size=256,
            intermediate_size=768,
            num_layers=6,
            num_heads=4,
            num_kv_heads=2,
            head_dim=64,
            max_position_embeddings=4096,
            rope_theta=1e6,
            tie_word_embeddings=True,
            init_std=0.0,  # > 0: redraw every weight matrix ~ N(0, init_std) (peaky random targets)
            attn_out_scale=1.0,  # < 1 scales o_proj: a random target close to a bigram model, whose
            # greedy outputs a small drafter learns in seconds (tests)
            init_seed=0,
        )
    )
    c.tokenizer_dir = ""  # default: target_path; in target mode a BPE is trained if empty
    c.tokenizer_vocab_size = 4096
    # Drafter architecture and the DFlash recipe.
    c.drafter = ml_collections.ConfigDict(
        dict(
            num_layers=5,
            num_taps=5,
            block_size=16,
            mask_token_id=-1,  # -1: tokenizer's / V-1
            intermediate_size=0,  # 0: the target's
            target_layer_ids=(),  # empty: the default spread of num_taps layers
            # Storage dtype of the trained drafter weights, hence of their AdamW moments (float32
            # masters, as SpecForge keeps); compute stays in `dtype`. "": the same as `dtype`.
            param_dtype="float32",
            init_path="",
            # "normal": fc ~ N(0, 0.02) as Hugging Face initializes; "tap_rms": its rows
            # scaled by median / RMS of their tapped feature (measured on a held-out batch) so
            # that no massive activation dimension dominates the context at step 0 (tried on
            # SmolLM2-135M: no faster start, benchmarks/results/smollm2/README.md).
            fc_init="normal",
            # > 0: a DFlash drafter's head is restricted to the draft_vocab_size most frequent
            # answer tokens of the training data (frozen rows of the target's head; labels
            # outside them weigh 0), saved with the drafter and used when drafting
            # (`dflash_jax/drafters/draft_vocab.py`); 0: the whole vocabulary.
            draft_vocab_size=0,
            # > 0: every drafter layer is sliding_attention with this window (a query at p
            # sees positions j with |p - j| < window), as DFlash 2 drafters are; 0: full.
            sliding_window=0,
            # DFlash 2 (enabled): grouped dynamic causal convolutions around every sublayer,
            # logits x output_multiplier soft-capped at final_logit_softcapping (0: none), and
            # the candidate selector, trained by its cross-entropy over the top-k candidates
            # (weight selector_weight) beside the drafter's own loss.
            # "dflash" (the block-diffusion drafter above) | "eagle3": an EAGLE-3 drafter (one
            # layer over 3 taps, `target_layer_ids` empty: EAGLE-3's default layers) trained
            # with training-time test (`dflash_jax/training/eagle3_ttt.py`): ttt_steps unrolled
            # drafting steps, step j's loss weighted ttt_decay^j, over a draft vocabulary of
            # the draft_vocab_size most frequent label tokens (0: the whole vocabulary).
            kind="dflash",
            eagle3=ml_collections.ConfigDict(dict(draft_vocab_size=0, ttt_steps=7, ttt_decay=0.8)),
            dflash2=ml_collections.ConfigDict(
                dict(
                    enabled=False,
                    conv_kernel_size=2,
                    conv_group_size=16,
                    selector_rank=256,
                    selector_top_k=16,
                    output_multiplier=1.0,
                    final_logit_softcapping=0.0,
                    selector_weight=1.0,
                )
            ),
        )
    )  # a z-lab drafter directory to continue from


def _recipe(c: ml_collections.ConfigDict) -> None:
    """The DFlash training recipe: anchors, loss, position weights, masks, attention."""
    c.num_anchors = 512  # per sequence (per document of a packed row), as SpecForge
    c.anchors_per_row = 0  # static blocks per packed row, shared by its documents; 0: num_anchors
    c.gamma = 7.0
    # "ce" | "kl" (the target's full distribution, its logits computed each step) | "topk_kl"
    # (the target's top-k read from data.tap_store: soft labels, no target pass; batches without
    # it, e.g. the held-out ones, score CE) | "topk_lk": -log of the sampled acceptance rate
    # sum_x min(p, q) against the same top-k (LK's negative log acceptance)
    c.loss = "ce"
    # Block-position weights: "decay" (exp(-(k-1)/gamma), the paper's) | "dpace": each position
    # by its share of the expected accepted length's gradient (training/losses.dpace_weights)
    c.position_weights = "decay"
    c.loss_positions = 0  # > 0: score only block positions 1..loss_positions
    # "all" | "random" | "mdlm" (dflash_jax.training.masks.mask_draw): "mdlm" mixes fully masked
    # blocks (a mask_full_fraction of them) with masked-diffusion blocks (ratio t ~ U(0,1], loss on
    # the masked positions weighted 1/t): a drafter for multi-pass denoising (denoise_steps > 1).
    c.mask_schedule = "all"
    c.mask_full_fraction = 0.5  # "mdlm" only
    c.loss_chunk_anchors = 0  # > 0: drafter logits for this many anchors at a time (memory)
    c.attention_impl = "xla"  # "xla" | "pallas" | "pallas_interpret"
    # The target's layers stacked and run as one lax.scan (dflash_jax/models/layer_stack.py):
    # the training step compiles one layer body (the frozen pass up to the last tap) whatever
    # the target's depth. Where the layers repeat; docs/performance.md says where it runs at
    # the loop's speed (TPU). A target-mode checkpoint keeps the layout it was written in.
    c.scan_layers = False
    c.use_segments = True


def _data(c: ml_collections.ConfigDict) -> None:
    """The data: documents, packing, gradient accumulation, regeneration, unlikelihood."""
    # Data.
    c.data = ml_collections.ConfigDict(
        dict(
            kind="stdlib",  # "stdlib" | "files" | "regenerated" | "synthetic"
            paths=(),
            data_dir="",
            max_files=0,
            validation_percent=3.0,
            include_tests=False,  # stdlib: add its test suites (held-out library files stay out)
            seq_len=3072,
            batch_size=8,
            num_epochs=6,
            shuffle=True,
            allow_split=True,
            num_shards=0,  # data streams the global batch is made of (0: one per JAX process)
            # Drafter mode: keep the frozen target's taps of every document piece in host
            # memory after its first epoch, so later epochs skip the target's pass (needs
            # allow_split=False; dflash_jax/training/tap_cache.py). Storage dtype beside it.
            cache_taps=False,
            cache_taps_dtype="float32",
            # Drafter mode: a tap store directory (`dflash_jax/training/tap_store.py`) built for
            # this data, target, taps and seq_len: every batch's taps (and top-k) are read from
            # disk and the target never runs in training (needs allow_split=False).
            tap_store="",
            num_docs=256,
            doc_len=64,
        )
    )  # synthetic: random-token documents
    # Gradient accumulation: the global batch data.batch_size is cut into this many micro-batches
    # (must divide it, and each micro-batch must split over the mesh's batch shards), run one
    # after another inside the one compiled step, with one optimizer update per step. The same
    # gradient, metrics and anchors as the whole batch at once; only the activation memory is a
    # micro-batch's (the paper's batch of 16 x 3072 on a TPU v4-8: docs/training.md).
    c.grad_accum_steps = 1
    c.regen = ml_collections.ConfigDict(
        dict(
            # "stdlib": random windows of prompt_len tokens of the training files; "functions":
            # code-completion prompts cut from them (context lines, a def header and its first
            # function_body_lines lines, at most prompt_len tokens); "mixed": half of each;
            # "random": random token ids; "file": the conversations of prompt_file (JSONL:
            # ShareGPT "conversations", OpenAI "messages" or plain "prompt", dflash_jax.data.chat),
            # every assistant turn regenerated in order, through the target's chat template when
            # chat_template and the tokenizer has one (rows: loss on assistant tokens only; all
            # of the file's conversations, num_prompts/prompt_len unused; max_new_tokens per turn).
            prompt_source="stdlib",
            prompt_file="",
            chat_template=True,
            num_prompts=512,
            prompt_len=64,
            max_new_tokens=256,
            temperature=0.0,
            batch_size=32,
            function_body_lines=2,
            functions_per_file=50,
            holdout_fraction=0.05,
            output="",  # output default: workdir/regenerated.jsonl
            only=False,
        )
    )  # True: write the responses (regen.output) and stop before training
    # Target mode: sequence-level unlikelihood on the model's own greedy continuations
    # (dflash_jax.training.unlikelihood): weight 0 = off. Prompts: `num_prompts` from the
    # training documents ("docs": random windows; "functions": code-completion prompts;
    # "mixed": half each), cut to their last prompt_len tokens; a continuation token inside an
    # n-gram (n = ngram) already generated earlier in it is pushed down by -log(1 - p).
    c.unlikelihood = ml_collections.ConfigDict(
        dict(
            weight=0.0,
            batch_size=8,
            prompt_len=128,
            max_new_tokens=64,
            ngram=4,
            prompt_source="mixed",
            num_prompts=4096,
        )
    )


def _optimization(c: ml_collections.ConfigDict) -> None:
    """AdamW with warmup and cosine decay, global-norm clipping, the schedule's length."""
    # Optimization.
    c.learning_rate = 6e-4
    c.warmup_ratio = 0.04
    c.end_lr_ratio = 0.0
    c.grad_clip = 1.0
    c.weight_decay = 0.0
    c.b1 = 0.9
    c.b2 = 0.999
    c.num_train_steps = -1  # -1: num_epochs over the training tokens
    c.stop_at_step = -1  # stop early (time-sliced jobs); the schedule is unchanged


def _loop(c: ml_collections.ConfigDict) -> None:
    """The loop: logging, evaluation, checkpoints, profiling, export."""
    # Loop.
    c.log_every = 10
    c.eval_every = 200
    c.eval_batches = 2
    c.eval_num_prompts = 8
    c.eval_prompt_len = 64
    c.eval_max_new_tokens = 64
    c.checkpoint_every = 200
    c.keep_checkpoints = 3
    c.async_checkpoint = True
    c.profile_dir = ""
    c.profile_start_step = 5
    c.profile_num_steps = 3
    c.export = True
