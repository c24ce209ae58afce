#!/usr/bin/env python
"""Run a small zero-shot commonsense suite (HellaSwag, PIQA, Winogrande, BoolQ) on a
checkpoint and push the numbers to Weights & Biases.

    torchrun --nproc_per_node=8 16_bench_suite_eval.py --model ckpts/step_120000 \
        --wandb_project pretrain-evals --run_name step_120000
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
import wandb
from datasets import load_dataset
from transformers import AutoModelForCausalLM, AutoTokenizer


def hellaswag(doc):
    ctx = doc["ctx_a"] + " " + doc["ctx_b"].capitalize()
    return doc["activity_label"] + ": " + ctx, [" " + e for e in doc["endings"]], int(doc["label"])


def piqa(doc):
    return f"Question: {doc['goal']}\nAnswer:", [" " + doc["sol1"], " " + doc["sol2"]], int(doc["label"])


def winogrande(doc):
    # partial scoring: the option is substituted into the context, the suffix is the continuation
    idx = doc["sentence"].index("_")
    suffix = " " + doc["sentence"][idx + 1:].strip()
    ctxs = [doc["sentence"][:idx] + opt for opt in (doc["option1"], doc["option2"])]
    return ctxs, [suffix, suffix], int(doc["answer"]) - 1


def boolq(doc):
    return f"{doc['passage']}\nQuestion: {doc['question']}?\nAnswer:", [" no", " yes"], int(doc["label"])


TASKS = {
    "hellaswag": ("Rowan/hellaswag", None, "validation", hellaswag),
    "piqa": ("ybisk/piqa", None, "validation", piqa),
    "winogrande": ("allenai/winogrande", "winogrande_xl", "validation", winogrande),
    "boolq": ("super_glue", "boolq", "validation", boolq),
}


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--tasks", nargs="+", default=list(TASKS))
    ap.add_argument("--batch_size", type=int, default=32)
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--wandb_project", default="evals")
    ap.add_argument("--wandb_entity", default=None)
    ap.add_argument("--run_name", default=None)
    ap.add_argument("--step", type=int, default=None, help="training step to log against")
    return ap.parse_args()


@torch.no_grad()
def score_pairs(model, tok, pairs, device, batch_size):
    """pairs: list of (context, continuation) -> list of (sum logprob, n_cont_tokens)."""
    results = []
    for s in range(0, len(pairs), batch_size):
        chunk = pairs[s:s + batch_size]
        seqs, cont_lens = [], []
        for ctx, cont in chunk:
            c_ids = tok(ctx)["input_ids"]
            x_ids = tok(cont, add_special_tokens=False)["input_ids"]
            seqs.append(c_ids + x_ids)
            cont_lens.append(len(x_ids))
        L = max(map(len, seqs))
        inp = torch.full((len(seqs), L), tok.pad_token_id, dtype=torch.long)
        for i, sq in enumerate(seqs):
            inp[i, :len(sq)] = torch.tensor(sq)
        inp = inp.to(device)
        logp = F.log_softmax(model(inp).logits.float(), dim=-1)
        for i, (sq, n) in enumerate(zip(seqs, cont_lens)):
            tgt = inp[i, len(sq) - n:len(sq)]
            lp = logp[i, len(sq) - n - 1:len(sq) - 1].gather(-1, tgt[:, None]).sum().item()
            results.append((lp, n))
    return results


def eval_task(name, model, tok, rank, world, device, args):
    path, cfg, split, fmt = TASKS[name]
    ds = load_dataset(path, cfg, split=split)
    if args.limit:
        ds = ds.select(range(min(args.limit, len(ds))))
    docs = [ds[i] for i in range(rank, len(ds), world)]
    pairs, owners = [], []
    for d_i, doc in enumerate(docs):
        ctx, conts, gold = fmt(doc)
        ctxs = ctx if isinstance(ctx, list) else [ctx] * len(conts)
        for c_i, (c, x) in enumerate(zip(ctxs, conts)):
            pairs.append((c, x))
            owners.append((d_i, c_i, gold))
    scores = score_pairs(model, tok, pairs, device, args.batch_size)

    best = {}
    for (d_i, c_i, gold), (lp, n) in zip(owners, scores):
        cur = best.get(d_i)
        norm = lp / n
        if cur is None:
            best[d_i] = {"gold": gold, "raw": (lp, c_i), "norm": (norm, c_i)}
        else:
            if lp > cur["raw"][0]:
                cur["raw"] = (lp, c_i)
            if norm > cur["norm"][0]:
                cur["norm"] = (norm, c_i)
    stats = torch.zeros(3, device=device, dtype=torch.float64)
    for b in best.values():
        stats[0] += float(b["raw"][1] == b["gold"])
        stats[1] += float(b["norm"][1] == b["gold"])
        stats[2] += 1
    dist.all_reduce(stats)
    return {"acc": (stats[0] / stats[2]).item(), "acc_norm": (stats[1] / stats[2]).item(),
            "n": int(stats[2].item())}


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    run = wandb.init(
        project=args.wandb_project,
        entity=args.wandb_entity,
        name=args.run_name or os.path.basename(args.model.rstrip("/")),
        config=vars(args),
        job_type="eval",
    )

    tok = AutoTokenizer.from_pretrained(args.model)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16).to(device)
    model.eval()

    summary = {}
    for name in args.tasks:
        t0 = time.time()
        res = eval_task(name, model, tok, rank, world, device, args)
        summary[name] = res
        if rank == 0:
            print(f"{name:12s} acc {res['acc']:.4f} acc_norm {res['acc_norm']:.4f} "
                  f"(n={res['n']}, {time.time() - t0:.0f}s)", flush=True)
        run.log({f"{name}/acc": res["acc"], f"{name}/acc_norm": res["acc_norm"]}, step=args.step)

    avg = sum(r["acc_norm"] for r in summary.values()) / len(summary)
    run.log({"avg/acc_norm": avg}, step=args.step)
    table = wandb.Table(columns=["task", "acc", "acc_norm", "n"],
                        data=[[k, v["acc"], v["acc_norm"], v["n"]] for k, v in summary.items()])
    run.log({"results": table}, step=args.step)
    if rank == 0:
        print(f"average acc_norm: {avg:.4f}")
    run.finish()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
