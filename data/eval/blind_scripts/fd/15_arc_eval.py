"""ARC-Challenge / ARC-Easy multiple choice eval, lm-eval-harness style.

Each answer choice is scored as the log-likelihood of the continuation given the
question; acc uses the raw sum, acc_norm divides by the continuation's byte length.

    torchrun --nproc_per_node=8 15_arc_eval.py --model meta-llama/Meta-Llama-3-8B \
        --subset ARC-Challenge --num_fewshot 25
"""
import argparse
import hashlib
import json
import os
import random
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from datasets import load_dataset
from transformers import AutoModelForCausalLM, AutoTokenizer


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--subset", default="ARC-Challenge", choices=["ARC-Challenge", "ARC-Easy"])
    ap.add_argument("--num_fewshot", type=int, default=25)
    ap.add_argument("--batch_size", type=int, default=16)
    ap.add_argument("--max_length", type=int, default=4096)
    ap.add_argument("--cache_dir", default=os.path.expanduser("~/.cache/arc_eval"))
    ap.add_argument("--output", default="results/arc.json")
    ap.add_argument("--seed", type=int, default=1234)
    return ap.parse_args()


def doc_to_text(doc):
    return f"Question: {doc['question']}\nAnswer:"


def build_requests(tokenizer, test, train, k, seed, max_length):
    """Tokenize (context, continuation) pairs for every doc and choice."""
    rng = random.Random(seed)
    requests = []
    for doc_id, doc in enumerate(test):
        shots = rng.sample(list(train), k) if k > 0 else []
        ctx = "".join(
            doc_to_text(s) + " " + s["choices"]["text"][s["choices"]["label"].index(s["answerKey"])] + "\n\n"
            for s in shots
        ) + doc_to_text(doc)
        gold = doc["choices"]["label"].index(doc["answerKey"])
        ctx_ids = tokenizer(ctx)["input_ids"]
        for c_idx, choice in enumerate(doc["choices"]["text"]):
            cont_ids = tokenizer(" " + choice, add_special_tokens=False)["input_ids"]
            ids = (ctx_ids + cont_ids)[-max_length:]
            requests.append({
                "doc_id": doc_id,
                "choice": c_idx,
                "gold": gold,
                "ids": ids,
                "cont_len": len(cont_ids),
                "cont_bytes": len((" " + choice).encode("utf-8")),
            })
    return requests


def cache_path(args):
    key = f"{args.model}|{args.subset}|{args.num_fewshot}|{args.seed}|{args.max_length}"
    h = hashlib.md5(key.encode()).hexdigest()[:12]
    return os.path.join(args.cache_dir, f"arc_requests_{h}.pt")


@torch.no_grad()
def loglikelihood(model, batch, pad_id, device):
    L = max(len(r["ids"]) for r in batch)
    inp = torch.full((len(batch), L), pad_id, dtype=torch.long)
    attn = torch.zeros((len(batch), L), dtype=torch.long)
    for i, r in enumerate(batch):
        inp[i, : len(r["ids"])] = torch.tensor(r["ids"])
        attn[i, : len(r["ids"])] = 1
    inp, attn = inp.to(device), attn.to(device)
    logprobs = F.log_softmax(model(input_ids=inp, attention_mask=attn).logits.float(), dim=-1)
    out = []
    for i, r in enumerate(batch):
        n, c = len(r["ids"]), r["cont_len"]
        targets = inp[i, n - c : n]
        lp = logprobs[i, n - c - 1 : n - 1].gather(-1, targets.unsqueeze(-1)).sum()
        out.append(lp.item())
    return out


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    test = load_dataset("allenai/ai2_arc", args.subset, split="test")
    train = load_dataset("allenai/ai2_arc", args.subset, split="train")

    path = cache_path(args)
    if os.path.exists(path):
        requests = torch.load(path)
    else:
        requests = build_requests(tokenizer, test, train, args.num_fewshot, args.seed, args.max_length)
        os.makedirs(args.cache_dir, exist_ok=True)
        torch.save(requests, path)
    n_docs = len(test)

    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16).to(device)
    model.eval()

    # split by document so all choices of a question land on the same rank
    mine = [r for r in requests if r["doc_id"] % world == rank]
    mine.sort(key=lambda r: len(r["ids"]), reverse=True)
    t0 = time.time()
    scores = {}
    for s in range(0, len(mine), args.batch_size):
        batch = mine[s : s + args.batch_size]
        for r, lp in zip(batch, loglikelihood(model, batch, pad_id, device)):
            scores[(r["doc_id"], r["choice"])] = (lp, lp / r["cont_bytes"], r["gold"])
        if rank == 0 and (s // args.batch_size) % 50 == 0:
            print(f"{s}/{len(mine)} requests ({time.time() - t0:.0f}s)", flush=True)

    per_doc = {}
    for (doc_id, choice), (lp, lp_norm, gold) in scores.items():
        per_doc.setdefault(doc_id, {"gold": gold, "lp": {}, "lpn": {}})
        per_doc[doc_id]["lp"][choice] = lp
        per_doc[doc_id]["lpn"][choice] = lp_norm

    counts = torch.zeros(3, dtype=torch.float64, device=device)  # acc, acc_norm, n
    for d in per_doc.values():
        counts[0] += float(max(d["lp"], key=d["lp"].get) == d["gold"])
        counts[1] += float(max(d["lpn"], key=d["lpn"].get) == d["gold"])
        counts[2] += 1
    dist.all_reduce(counts)

    if rank == 0:
        acc, acc_norm, n = counts.tolist()
        assert int(n) == n_docs, (n, n_docs)
        res = {
            "model": args.model,
            "task": args.subset,
            "num_fewshot": args.num_fewshot,
            "acc": acc / n,
            "acc_norm": acc_norm / n,
            "n": int(n),
            "seconds": round(time.time() - t0, 1),
        }
        print(json.dumps(res, indent=2))
        os.makedirs(os.path.dirname(args.output) or ".", exist_ok=True)
        with open(args.output, "w") as f:
            json.dump(res, f, indent=2)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
