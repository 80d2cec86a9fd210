"""GPU benchmark: our DPO (ref_logps + one epoch) and reward-model training vs the TRL anchor, one run, one GPU.

    python bench/gpu_bench.py --shared ../shared --out bench/results/h200.json [--trl-wheels .whl] \
        [--pairs 512] [--modes ours,trl] [--shape qwen2.5-0.5b] [--max-length 1024]

Workload (the anchor's, ../shared/bench/trl_anchor.py): random-init Qwen2.5-0.5B shape (GPT-2 tokenizer,
vocab 151,936), the first N HH-RLHF harmless pairs, 8 pairs per optimizer step, max_length 1024, bf16, one
epoch. Ours runs the real stage CLIs under torchrun (`torchrun --nproc-per-node 1 -m stages.ref_logps`,
`stages.train_dpo`, `stages.train_rm`, exactly as the Snakemake rules launch them) on token parquet made by
our normalize + tokenize code. Tokens = chosen + rejected sequence tokens, as TRL's num_tokens.
DPO end-to-end time = reference pass + training epoch (TRL's dpo_tuned precomputes inside its timer too).

MFU = model FLOPs / time / measured bf16 matmul peak (8192^3 products in this process):
training 6 * N_params * tokens + reference 2 * N_params * tokens, plus causal attention
(fwd 2 * 2 * L * d_model * sum(len^2)/2, x3 for fwd+bwd). N_params counts the tied embedding once.
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SHAPES = {
    "qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2),   # a CPU smoke test of this script, not a benchmark
    "qwen2.5-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                         num_key_value_heads=2),
}
NCCL_SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def sh(cmd: list[str], env: dict | None = None, cwd: Path | None = None, log: Path | None = None) -> float:
    t0 = time.perf_counter()
    with open(log, "w") if log else open(os.devnull, "w") as f:
        r = subprocess.run(cmd, env={**os.environ, **NCCL_SAFE_ENV, **(env or {})}, cwd=cwd, stdout=f,
                           stderr=subprocess.STDOUT)
    if r.returncode != 0:
        tail = Path(log).read_text()[-6000:] if log else ""
        raise SystemExit(f"{' '.join(cmd)} failed ({r.returncode}):\n{tail}")
    return time.perf_counter() - t0


def matmul_peak_tflops() -> float | None:
    import torch
    if not torch.cuda.is_available():
        return None
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        a @ b
    end.record()
    torch.cuda.synchronize()
    return 2 * 8192 ** 3 * 10 / (start.elapsed_time(end) / 1e3) / 1e12


# ------------------------------------------------------------------------------------------------
# Workload: HH pairs -> our token parquet; a random-init model directory
# ------------------------------------------------------------------------------------------------

def hh_lines(hh: Path, concat: int = 1) -> list[str]:
    """HH-RLHF rows as JSONL lines. concat K > 1: "long concatenations": row j becomes rows j..j+K-1 as one
    dialogue, the chosen transcripts of the first K-1 as shared context, then row j+K-1's chosen / rejected
    (still HH format: the last Assistant turn is the completion)."""
    lines = gzip.open(hh, "rt").read().splitlines()
    if concat <= 1:
        return lines
    rows = [json.loads(l) for l in lines]
    out = []
    for j in range(len(rows) - concat + 1):
        context = "".join(r["chosen"] for r in rows[j:j + concat - 1])
        last = rows[j + concat - 1]
        out.append(json.dumps({"chosen": context + last["chosen"], "rejected": context + last["rejected"]}))
    return out


def prepare_tokens(hh: Path, gpt2: Path, n_pairs: int, n_probe: int, max_length: int, work: Path,
                   concat: int = 1) -> dict:
    from stages.lib.io import write_parquet
    from stages.engine.packing import load_token_pairs, shares_prompt
    from stages.normalize import normalize_sources
    from stages.tokenize import PairTokenizer, TokenizeLimits, load_tokenizer, tokenize_pairs, tokens_table

    lines = hh_lines(hh, concat)
    subsets = {"train": lines[:n_pairs], "probe": lines[-n_probe:]}   # probe far from the train rows
    with gzip.open(work / "trl_train.jsonl.gz", "wt") as f:          # exactly the train rows, for the TRL runner
        f.write("\n".join(subsets["train"]) + "\n")
    tok = PairTokenizer(load_tokenizer(gpt2))
    # TRL truncates sequences to max_length; ours keeps the prompt and cuts the completion to fit.
    limits = TokenizeLimits(max_length, max_length - 64, "truncate_completion")
    out = {}
    for split, rows in subsets.items():
        src = work / f"hh_{split}.jsonl"
        src.write_text("\n".join(rows) + "\n")
        norm = normalize_sources([{"name": "hh", "path": str(src), "format": "hh"}])
        result = tokenize_pairs(tok, norm.pairs, limits, split)
        write_parquet(work / f"{split}_tokens.parquet", tokens_table(result.rows))
        seq_tokens = sum(len(r["chosen_ids"]) + len(r["rejected_ids"]) for r in result.rows)
        # what the shared-prompt layout actually runs: each pair's common prompt once (packing's own test)
        pairs = load_token_pairs(work / f"{split}_tokens.parquet")
        shared = sum(int(pairs.seq_prompt_lens[2 * p]) for p in range(len(pairs)) if shares_prompt(pairs, p))
        sq = sum(len(r["chosen_ids"]) ** 2 + len(r["rejected_ids"]) ** 2 for r in result.rows)
        out[split] = {"rows_in": len(rows), "pairs": len(result.rows), "normalize_rejected": len(norm.rejections),
                      "tokenize_rejected": len(result.rejections), "tokens": seq_tokens, "shared_prompt_tokens": shared, "sum_len_sq": sq}
    return out


def make_model(shape: str, gpt2: Path, work: Path) -> tuple[Path, int, dict]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config
    tok = AutoTokenizer.from_pretrained(gpt2)
    cfg = Qwen2Config(**SHAPES[shape], vocab_size=151936, max_position_embeddings=32768, tie_word_embeddings=True,
                      rope_theta=1e6, pad_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id,
                      bos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    n_params = sum(p.numel() for p in model.parameters())
    out = work / f"model-{shape}"
    model.save_pretrained(out)
    return out, n_params, SHAPES[shape]


def bench_params(base: dict, overrides: dict) -> dict:
    params = json.loads(json.dumps(base))
    for dotted, value in overrides.items():
        node = params
        *parents, leaf = dotted.split(".")
        for p in parents:
            node = node[p]
        node[leaf] = value
    return params


def run_stage(stage: str, params_file: Path, model_dir: Path, work: Path, extra: list[str], logs: Path,
              env: dict | None = None) -> dict:
    """One stage CLI under torchrun, as the Snakemake rules launch it -> its perf record (timings, throughput,
    memory: logs/ours_<stage>.perf.json) with "wall_s" added, and for a training stage (extra has --out-dir)
    its run_info.json too. Logs go to logs/ours_<stage>.{log,out}."""
    common = ["--params", str(params_file), "--model-dir", str(model_dir),
              "--train-tokens", str(work / "train_tokens.parquet"), "--probe-tokens", str(work / "probe_tokens.parquet")]
    run = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", "-m"]
    perf = logs / f"ours_{stage}.perf.json"
    wall = sh(run + [f"stages.{stage}", "--", *common, *extra, "--log", str(logs / f"ours_{stage}.log"), "--perf", str(perf)],
              env={"PYTHONPATH": f"{REPO}:{os.environ.get('PYTHONPATH', '')}", **(env or {})}, cwd=REPO,
              log=logs / f"ours_{stage}.out")
    res = {**json.loads(perf.read_text()), "wall_s": round(wall, 2)}
    if "--out-dir" not in extra:
        return res
    out_dir = Path(extra[extra.index("--out-dir") + 1])
    info = json.loads((out_dir / "run_info.json").read_text())
    # run_info's cuda_graphs holds the facts (shapes, optimizer), perf's the capture and first-step seconds.
    return {**info, **res, "cuda_graphs": {**info.get("cuda_graphs", {}), **res.get("cuda_graphs", {})}}


def run_ours(work: Path, model_dir: Path, params: dict, out: Path) -> dict:
    params_file = work / "params.yaml"
    params_file.write_text(yaml.safe_dump(params))
    res = {"ref_logps": run_stage("ref_logps", params_file, model_dir, work, ["--out", str(work / "ref_logps.parquet")], out)}
    # The stage's perf record has each pass's compute time: the train split's is the reference pass.
    res["ref_logps"]["train_seconds"] = res["ref_logps"]["train"]["pass_seconds"]
    for stage, extra in (("train_dpo", ["--ref-logps", str(work / "ref_logps.parquet")]), ("train_rm", [])):
        res[stage] = run_stage(stage, params_file, model_dir, work, [*extra, "--out-dir", str(work / stage)], out)
        shutil.copy(work / stage / "train_log.csv", out / f"ours_{stage}_train_log.csv")
    return res


ANCHOR_SHAPE = "hidden_size=896, intermediate_size=4864, num_hidden_layers=layers, num_attention_heads=14"
ANCHOR_DATA = '"../shared/data/hh-rlhf/harmless-base-test.jsonl.gz"'


def patched_trl_anchor(anchor: Path, shape: str, max_length: int, data: Path | None, dest: Path) -> Path:
    """The TRL anchor with only its workload changed: model shape, max_length (and its token-count cap),
    and the train rows file, written to `dest`; the anchor itself when nothing changes. Every substitution
    must hit, so a changed anchor fails loudly here."""
    text = anchor.read_text()
    subs = []
    if shape != "qwen2.5-0.5b":
        sh = SHAPES[shape]
        subs.append((ANCHOR_SHAPE, f"hidden_size={sh['hidden_size']}, intermediate_size={sh['intermediate_size']}, "
                                   f"num_hidden_layers=layers, num_attention_heads={sh['num_attention_heads']}"))
    if max_length != 1024:
        subs += [("max_length=1024", f"max_length={max_length}"), (", 1024)", f", {max_length})"),
                 ("max_position_embeddings=4096", f"max_position_embeddings={max(4096, max_length)}")]
    if data is not None:
        subs.append((ANCHOR_DATA, json.dumps(str(data))))
    if not subs:
        return anchor                        # the anchor's own workload: run the anchor itself
    for old, new in subs:
        if old not in text:
            raise SystemExit(f"{anchor}: cannot patch the TRL anchor (no {old!r}); update bench/gpu_bench.py")
        text = text.replace(old, new)
    dest.write_text(text)
    return dest


def run_trl(mode: str, n_pairs: int, shared: Path, wheels_site: str | None, out: Path, script: Path | None = None,
            layers: int | None = None) -> dict:
    # trl_anchor.py reads ../shared/data relative to its cwd: give it a sibling of `shared`.
    cwd = shared.parent / "trl_cwd"
    cwd.mkdir(exist_ok=True)
    env = {"HF_HUB_OFFLINE": "1"}
    if wheels_site:
        env["PYTHONPATH"] = wheels_site
    if layers:
        env["LAYERS"] = str(layers)
    sh([sys.executable, str(script or shared / "bench" / "trl_anchor.py"), mode, str(n_pairs)], env=env, cwd=cwd,
       log=out / f"trl_{mode}.out")
    last = [l for l in (out / f"trl_{mode}.out").read_text().splitlines() if l.startswith("{")][-1]
    return json.loads(last)


def flops(n_params: int, shape: dict, tokens: int, sum_len_sq: int, passes: int) -> float:
    """passes: 3 for training (fwd + bwd), 1 for a forward-only pass."""
    attn = 2 * 2 * shape["num_hidden_layers"] * shape["hidden_size"] * sum_len_sq / 2
    return passes * (2 * n_params * tokens + attn)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shared", default=str(REPO.parent / "shared"))
    ap.add_argument("--out", required=True, help="results JSON (a table is printed too)")
    ap.add_argument("--pairs", type=int, default=512)
    ap.add_argument("--probe-pairs", type=int, default=64)
    ap.add_argument("--shape", default="qwen2.5-0.5b", choices=sorted(SHAPES))
    ap.add_argument("--max-length", type=int, default=1024)
    ap.add_argument("--modes", default="ours,trl")
    ap.add_argument("--trl-site", help="a directory with trl/datasets installed (pip --target)")
    ap.add_argument("--trl-script", help="another TRL runner than ../shared/bench/trl_anchor.py (default: the anchor, "
                    "patched to --shape / --max-length / --concat when they differ from its own)")
    ap.add_argument("--concat", type=int, default=1, help="long concatenations: each pair = K consecutive HH dialogues")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="params overrides, e.g. train.compile=true")
    ap.add_argument("--work", default="/tmp/prefpipe_bench")
    args = ap.parse_args(argv)

    import torch
    shared = Path(args.shared).resolve()
    hh = shared / "data" / "hh-rlhf" / "harmless-base-test.jsonl.gz"
    gpt2 = shared / "data" / "tokenizers" / "gpt2"
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    out_json = Path(args.out)
    logs = out_json.parent
    logs.mkdir(parents=True, exist_ok=True)

    cuda = torch.cuda.is_available()
    result = {"gpu": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__, "shape": args.shape,
              "pairs": args.pairs, "max_length": args.max_length, "concat": args.concat,
              "command": "python bench/gpu_bench.py " + " ".join(argv if argv is not None else sys.argv[1:])}
    import transformers
    result["transformers"] = transformers.__version__
    peak_tflops = matmul_peak_tflops()
    result["matmul_peak_tflops"] = round(peak_tflops, 1) if peak_tflops else None
    result["workload"] = prepare_tokens(hh, gpt2, args.pairs, args.probe_pairs, args.max_length, work, args.concat)
    model_dir, n_params, shape = make_model(args.shape, gpt2, work)
    result["model_parameters"] = n_params
    overrides = {"train.gpus": 1 if cuda else 0, "train.epochs": 1, "train.global_batch_pairs": 8, "train.lr": 5e-7,
                 "train.warmup_ratio": 0.0, "train.micro_batch_tokens": 16384, "tokenize.max_length": args.max_length,
                 "rm.center_rewards_coefficient": 0.0}
    for kv in args.set:
        k, v = kv.split("=", 1)
        overrides[k] = yaml.safe_load(v)
    result["overrides"] = overrides
    base = yaml.safe_load((REPO / "params.yaml").read_text())
    params = bench_params(base, overrides)
    w = result["workload"]["train"]
    peak = (peak_tflops or float("nan")) * 1e12
    rows = []
    def save_partial() -> None:   # a run cut short by its time limit still leaves what it measured
        out_json.write_text(json.dumps({**result, "table": rows}, indent=2, sort_keys=True) + "\n")

    if "ours" in args.modes:
        ours = run_ours(work, model_dir, params, logs)
        result["ours"] = ours
        save_partial()
        ref_s = ours["ref_logps"].get("train_seconds", ours["ref_logps"]["wall_s"])
        dpo_s = ref_s + ours["train_dpo"]["train_seconds"]
        rm_s = ours["train_rm"]["train_seconds"]
        f_dpo = flops(n_params, shape, w["tokens"], w["sum_len_sq"], 3) + flops(n_params, shape, w["tokens"], w["sum_len_sq"], 1)
        f_rm = flops(n_params, shape, w["tokens"], w["sum_len_sq"], 3)
        for name, secs, fl, info in (("ours_dpo", dpo_s, f_dpo, ours["train_dpo"]), ("ours_rm", rm_s, f_rm, ours["train_rm"])):
            # mfu: the model-FLOPs formula on workload tokens; mfu_hw: the same on the tokens the
            # shared-prompt layout really computes (attention term unchanged), i.e. hardware utilisation.
            computed = w["tokens"] - (w["shared_prompt_tokens"] if params["train"]["share_prompt"] else 0)
            fl_hw = fl * computed / w["tokens"]
            rows.append({"mode": name, "seconds": round(secs, 2), "tokens": w["tokens"], "tokens_per_s": round(w["tokens"] / secs),
                         "pairs_per_s": round(w["pairs"] / secs, 2), "mfu": round(fl / secs / peak, 4) if cuda else None,
                         "mfu_hw": round(fl_hw / secs / peak, 4) if cuda else None, "computed_tokens": computed,
                         "peak_mem_gib": round(max(info["peak_memory_bytes_per_rank"]) / 2**30, 2)})
        save_partial()
    if "trl" in args.modes:
        script = Path(args.trl_script).resolve() if args.trl_script else patched_trl_anchor(
            shared / "bench" / "trl_anchor.py", args.shape, args.max_length,
            work / "trl_train.jsonl.gz" if args.concat > 1 else None, shared / "bench" / "trl_anchor_patched.py")
        for mode in ("dpo_tuned", "rm_tuned"):
            try:
                t = run_trl(mode, args.pairs, shared, args.trl_site, logs, script, SHAPES[args.shape]["num_hidden_layers"])
            except SystemExit as e:           # e.g. TRL out of memory at a long max_length: record it, go on
                result[f"trl_{mode}"] = {"error": str(e)[-3000:]}
                save_partial()
                rows.append({"mode": f"trl_{mode}", "error": "failed (see trl_*.out)"})
                continue
            result[f"trl_{mode}"] = t
            rows.append({"mode": f"trl_{mode}", "seconds": t["train_s"], "tokens": t["counted_tokens"],
                         "tokens_per_s": t["tokens_per_s"], "pairs_per_s": t["pairs_per_s"], "mfu": None,
                         "peak_mem_gib": t["peak_mem_gib"]})
            save_partial()
    by = {r["mode"]: r for r in rows if "tokens_per_s" in r}
    for kind in ("dpo", "rm"):
        ours, trl = by.get(f"ours_{kind}"), by.get(f"trl_{kind}_tuned")
        if ours and trl:
            result[f"ratio_{kind}"] = round(ours["tokens_per_s"] / trl["tokens_per_s"], 2)
            ours["ratio_to_trl"], trl["ratio_to_trl"] = result[f"ratio_{kind}"], 1.0
    if "ours_dpo" in by:
        result["mfu_dpo"] = by["ours_dpo"]["mfu"]
        result["mfu_rm"] = by["ours_rm"]["mfu"]
    result["table"] = rows
    out_json.write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
    cols = ["mode", "seconds", "tokens", "tokens_per_s", "pairs_per_s", "ratio_to_trl", "mfu", "mfu_hw", "peak_mem_gib"]
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(str(r.get(c, "")) for c in cols) + " |")
    print(json.dumps({k: result.get(k) for k in ("gpu", "matmul_peak_tflops", "ratio_dpo", "ratio_rm", "mfu_dpo")}))


if __name__ == "__main__":
    main()
