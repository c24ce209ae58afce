#!/usr/bin/env python
"""Sliding-window perplexity of a causal LM on WikiText / PG-19 / a local text file.

    torchrun --nproc_per_node=8 11_ppl_eval.py --model EleutherAI/pythia-6.9b \
        --dataset wikitext --config wikitext-103-raw-v1 --ctx 2048 --stride 512

The token stream is cut into overlapping windows; windows are dealt out to the
ranks round-robin and the summed NLL / token counts are reduced at the end.
"""
import argparse
import json
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from datasets import load_dataset
from transformers import AutoModelForCausalLM, AutoTokenizer


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--dataset", default="wikitext")
    ap.add_argument("--config", default="wikitext-2-raw-v1")
    ap.add_argument("--split", default="test")
    ap.add_argument("--text_file", default=None, help="use a local text file instead")
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--stride", type=int, default=512)
    ap.add_argument("--batch_size", type=int, default=4)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--output", default=None)
    return ap.parse_args()


def load_text(args):
    if args.text_file:
        with open(args.text_file, encoding="utf-8") as f:
            return f.read()
    ds = load_dataset(args.dataset, args.config, split=args.split)
    return "\n\n".join(ds["text"])


def make_windows(n_tokens, ctx, stride):
    """(begin, end, n_target) triples; only the last n_target tokens of each window are scored."""
    windows, prev_end = [], 0
    for begin in range(0, n_tokens, stride):
        end = min(begin + ctx, n_tokens)
        windows.append((begin, end, end - prev_end))
        prev_end = end
        if end == n_tokens:
            break
    return windows


@torch.no_grad()
def window_nll(model, ids, windows, device):
    """Summed NLL over the scored tokens of a batch of equal-length windows."""
    inputs = torch.stack([ids[b:e] for b, e, _ in windows]).to(device)
    logits = model(inputs).logits[:, :-1].float()
    targets = inputs[:, 1:]
    nll = F.cross_entropy(logits.transpose(1, 2), targets, reduction="none")  # [B, L-1]
    total, count = 0.0, 0
    for row, (_, _, n_tgt) in enumerate(windows):
        n = min(n_tgt, nll.size(1))
        total += nll[row, -n:].sum().item()
        count += n
    return total, count


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    world = dist.get_world_size()
    device = torch.device("cuda", local_rank)

    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=getattr(torch, args.dtype))
    model.to(device).eval()

    text = load_text(args)
    ids = torch.tensor(tok(text)["input_ids"], dtype=torch.long)
    windows = make_windows(len(ids), args.ctx, args.stride)
    if rank == 0:
        print(f"{len(ids):,} tokens -> {len(windows)} windows of {args.ctx} (stride {args.stride})")

    mine = windows[rank::world]
    # group windows of the same length so they can be stacked
    by_len = {}
    for w in mine:
        by_len.setdefault(w[1] - w[0], []).append(w)

    nll_sum, n_tokens = 0.0, 0
    t0 = time.time()
    done = 0
    for length, group in sorted(by_len.items(), reverse=True):
        for s in range(0, len(group), args.batch_size):
            chunk = group[s : s + args.batch_size]
            total, count = window_nll(model, ids, chunk, device)
            nll_sum += total
            n_tokens += count
            done += len(chunk)
            if rank == 0 and done % (args.batch_size * 25) == 0:
                print(f"  {done}/{len(mine)} windows, running ppl {math.exp(nll_sum / n_tokens):.3f}",
                      flush=True)

    stats = torch.tensor([nll_sum, n_tokens], dtype=torch.float64)
    dist.all_reduce(stats, op=dist.ReduceOp.SUM)
    total_nll, total_tokens = stats.tolist()

    if rank == 0:
        ppl = math.exp(total_nll / total_tokens)
        result = {
            "model": args.model,
            "dataset": args.text_file or f"{args.dataset}/{args.config}/{args.split}",
            "ctx": args.ctx,
            "stride": args.stride,
            "tokens_scored": int(total_tokens),
            "nll_per_token": total_nll / total_tokens,
            "perplexity": ppl,
            "seconds": round(time.time() - t0, 1),
        }
        print(json.dumps(result, indent=2))
        if args.output:
            os.makedirs(os.path.dirname(args.output) or ".", exist_ok=True)
            with open(args.output, "w") as f:
                json.dump(result, f, indent=2)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
