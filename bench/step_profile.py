"""Where a training step's time goes: time and profile DPO training-step variants on one GPU.

    python bench/step_profile.py --shared ../shared --out bench/results/step_profile_h200.json \
        [--variants amp_ddp,amp,bf16,bf16_compile] [--profile bf16,bf16_compile] [--pairs 512]

The anchor workload of gpu_bench.py (HH-RLHF pairs through our normalize + tokenize, random-init
Qwen2.5-0.5B shape, 8 pairs per optimizer step, one packed micro-batch per step) is run step by step
with the trainer's own pieces (SequenceLogProbs, the packing plan, fused AdamW, clipping) in variants:
  amp_ddp   fp32 weights, bf16 autocast, DDP wrapper (the trainer before this work)
  amp       the same without the DDP wrapper (world size 1)
  bf16      bf16 weights, no autocast (TRL's anchor trains like this)
  *_shared  the shared-prompt layout (a pair's prompt computed once; packing.PackedBatch)
  *_compile + torch.compile(dynamic=True) of every decoder layer and of the log-prob chunk function
For each: first-step seconds (includes compilation), steady ms/step, epoch seconds, tokens/s, peak
memory. With --profile, torch.profiler over 6 steady steps: CPU time of the step vs GPU kernel
time, and the top kernels. Also: the reference (no-grad) pass per variant.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))


def build(variant: str, model_dir: Path, chunk_tokens: int = 2048):
    import torch
    from stages.lib.modeling import SequenceLogProbs, load_causal_lm
    from stages.lib.trainer import disable_dropout
    bf16 = variant.startswith("bf16")
    compiled = "_compile" in variant
    module = SequenceLogProbs(load_causal_lm(model_dir, dtype=torch.bfloat16 if bf16 else torch.float32),
                              chunk_tokens=chunk_tokens, compile_chunks=compiled)
    disable_dropout(module)
    module.to(DEVICE)
    if compiled:
        for layer in module.lm.model.layers:
            layer.compile(dynamic=True)
    return module, bf16


def run_variant(variant: str, model_dir: Path, batches: list, profile: bool, out_dir: Path) -> dict:
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP
    module, bf16 = build(variant, model_dir)
    model = (DDP(module, device_ids=[0] if DEVICE.type == "cuda" else None, broadcast_buffers=False)
             if variant == "amp_ddp" else module)
    opt = torch.optim.AdamW(module.parameters(), lr=5e-7, fused=DEVICE.type == "cuda")
    cuda = DEVICE.type == "cuda"
    amp = torch.autocast(DEVICE.type, dtype=torch.bfloat16, enabled=cuda and not bf16)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if cuda:
        torch.cuda.reset_peak_memory_stats()

    def step(batch):
        with amp:
            out = model(**batch)
        pc, pr = out.view(-1, 2).unbind(-1)
        loss = -torch.nn.functional.logsigmoid(0.1 * (pc - pr)).sum() / 8
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0)
        torch._assert_async(torch.isfinite(norm), "grad norm")
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    sync()
    t0 = time.perf_counter()
    losses = []
    marks = {}
    for i, b in enumerate(batches):
        losses.append(step(b))
        if i in (0, 4):
            sync()
            marks[i] = time.perf_counter()
    sync()
    t_end = time.perf_counter()
    res = {"variant": variant, "first_step_s": round(marks[0] - t0, 3),
           "steady_ms_per_step": round((t_end - marks[4]) / (len(batches) - 5) * 1e3, 2),
           "epoch_s": round(t_end - t0, 3), "computed_tokens": sum(b["input_ids"].shape[1] for b in batches),
           "tokens": sum(int(t) for t in TOKENS),
           "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None,
           "final_loss": float(torch.stack(losses)[-8:].float().mean())}
    res["tokens_per_s"] = round(res["tokens"] / res["epoch_s"])
    # CPU time of the step alone (no sync): how long the host takes to queue one step
    sync()
    t = time.perf_counter()
    for b in batches[5:15]:
        step(b)
    res["host_queue_ms_per_step"] = round((time.perf_counter() - t) / 10 * 1e3, 2)
    sync()
    res["sync_ms_per_step_10"] = round((time.perf_counter() - t) / 10 * 1e3, 2)
    if profile:
        from torch.profiler import ProfilerActivity, profile as tprofile
        with tprofile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for b in batches[20:26]:
                step(b)
            sync()
        ka = prof.key_averages()
        gpu_us = sum(e.self_device_time_total for e in ka if e.device_type.name == "CUDA") / 6
        table = ka.table(sort_by="self_cuda_time_total", row_limit=30)
        (out_dir / f"profile_{variant}.txt").write_text(table)
        prof.export_chrome_trace(str(out_dir / f"trace_{variant}.json"))
        res["profile_gpu_kernel_ms_per_step"] = round(gpu_us / 1e3, 2)
        res["profile_n_kernels_per_step"] = round(sum(e.count for e in ka if e.device_type.name == "CUDA") / 6)
        print(table[:6000])
    # reference pass: no grad, params' inference_micro_batch_tokens micro-batches over the same pairs
    model.eval()
    sync()
    t = time.perf_counter()
    with torch.no_grad(), amp:
        for b in REF_BATCHES:
            model(**b)
    res["ref_pass_host_s"] = round(time.perf_counter() - t, 3)    # queueing only: ~ref_pass_s = host-bound
    sync()
    res["ref_pass_s"] = round(time.perf_counter() - t, 3)
    del model, module, opt
    torch.cuda.empty_cache()
    return res


def shared_prompt_attention_check() -> dict:
    """Does torch varlen attention align causal masks bottom-right when q and k lengths differ?
    (Needed to compute a pair's prompt once: rejected-completion queries over [prompt; rejected] keys.)"""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention.varlen import varlen_attn
    torch.manual_seed(0)
    H, D = 14, 64
    lq, lk = [37, 200, 5], [100, 333, 64]
    q = torch.randn(sum(lq), H, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(sum(lk), H, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(sum(lk), H, D, device="cuda", dtype=torch.bfloat16)
    cq = torch.tensor([0, *torch.tensor(lq).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    ck = torch.tensor([0, *torch.tensor(lk).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    out = varlen_attn(q, k, v, cq, ck, max(lq), max(lk), window_size=(-1, 0))
    errs = {}
    for name, align in (("bottom_right", "br"), ("top_left", "tl")):
        ref = []
        for i in range(3):
            qs = q[cq[i]:cq[i + 1]].float().transpose(0, 1)
            ks = k[ck[i]:ck[i + 1]].float().transpose(0, 1)
            vs = v[ck[i]:ck[i + 1]].float().transpose(0, 1)
            iq = torch.arange(lq[i], device="cuda")[:, None]
            ik = torch.arange(lk[i], device="cuda")[None]
            mask = ik <= iq + (lk[i] - lq[i]) if align == "br" else ik <= iq
            ref.append(F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask).transpose(0, 1))
        errs[name] = float((out.float() - torch.cat(ref)).abs().max())
    return errs


REF_BATCHES: list = []
TOKENS: list = []
DEVICE = None


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shared", default=str(REPO.parent / "shared"))
    ap.add_argument("--out", required=True)
    ap.add_argument("--pairs", type=int, default=512)
    ap.add_argument("--variants", default="amp_ddp,amp,bf16,bf16_compile")
    ap.add_argument("--profile", default="bf16,bf16_compile")
    ap.add_argument("--work", default="/tmp/prefpipe_profile")
    ap.add_argument("--shape", default="qwen2.5-0.5b", help="'tiny' = a CPU smoke test of this script")
    args = ap.parse_args(argv)
    import shutil
    import torch
    import torch.distributed as dist
    import gpu_bench
    from stages.lib.packing import build_packed_batch, load_token_pairs, plan_inference, plan_training
    from stages.lib.trainer import model_inputs
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    shared = Path(args.shared).resolve()
    result = {"command": "python bench/step_profile.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "torch": torch.__version__}
    global DEVICE
    DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        result["shared_prompt_attention_max_err"] = shared_prompt_attention_check()
    except Exception as e:  # noqa: BLE001 - record and go on
        result["shared_prompt_attention_max_err"] = repr(e)
    print(result, flush=True)
    gpu_bench.prepare_tokens(shared / "data/hh-rlhf/harmless-base-test.jsonl.gz", shared / "data/tokenizers/gpt2",
                             args.pairs, 64, 1024, work)
    model_dir, n_params, _ = gpu_bench.make_model(args.shape, shared / "data/tokenizers/gpt2", work)
    pairs = load_token_pairs(work / "train_tokens.parquet")
    plans = plan_training(pairs.pair_tokens, epochs=1, world_size=1, global_batch_pairs=8, micro_batch_tokens=16384,
                          seed=1234)

    def on_gpu(mb, shared):
        b = build_packed_batch(pairs, mb, share_prompt=shared).to(DEVICE)
        return model_inputs(b)
    TOKENS.extend(pairs.pair_tokens[mb].sum() for p in plans for mb in p.rank_micro_batches[0])
    import yaml   # the reference pass packs like the stage: params' inference budget
    ref_budget = yaml.safe_load((REPO / "params.yaml").read_text())["train"]["inference_micro_batch_tokens"]
    ref_plan = plan_inference(pairs.pair_tokens, micro_batch_tokens=ref_budget, world_size=1)[0]
    layouts = {shared: ([on_gpu(mb, shared) for p in plans for mb in p.rank_micro_batches[0]],
                        [on_gpu(mb, shared) for mb in ref_plan]) for shared in (False, True)}
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("nccl" if DEVICE.type == "cuda" else "gloo", rank=0, world_size=1)
    result["variants"] = []
    for v in args.variants.split(","):
        batches, ref_batches = layouts[v.endswith("_shared")]
        REF_BATCHES[:] = ref_batches
        try:
            r = run_variant(v, model_dir, batches, v in args.profile.split(","), out.parent)
        except Exception as e:  # noqa: BLE001 - one failing variant must not lose the others
            import traceback
            traceback.print_exc()
            r = {"variant": v, "error": repr(e)[:2000]}
        print(json.dumps(r), flush=True)
        result["variants"].append(r)
        out.write_text(json.dumps(result, indent=2) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
