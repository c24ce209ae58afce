"""GSM8K chain-of-thought eval with self-consistency (maj@k).

Usage:
    torchrun --nproc_per_node=8 06_gsm8k_sampling_eval.py --model mistralai/Mistral-7B-v0.1 \
        --num_samples 8 --limit 500
"""
import argparse
import json
import os
import random
import re
from collections import Counter

import numpy as np
import torch
import torch.distributed as dist
from datasets import load_dataset
from transformers import AutoModelForCausalLM, AutoTokenizer

FEWSHOT = [
    ("There are 15 trees in the grove. Grove workers will plant trees in the grove today. "
     "After they are done, there will be 21 trees. How many trees did the grove workers plant today?",
     "There are 15 trees originally. Then there were 21 trees after some more were planted. "
     "So there must have been 21 - 15 = 6. The answer is 6."),
    ("If there are 3 cars in the parking lot and 2 more cars arrive, how many cars are in the parking lot?",
     "There are originally 3 cars. 2 more cars arrive. 3 + 2 = 5. The answer is 5."),
    ("Leah had 32 chocolates and her sister had 42. If they ate 35, how many pieces do they have left in total?",
     "Originally, Leah had 32 chocolates. Her sister had 42. So in total they had 32 + 42 = 74. "
     "After eating 35, they had 74 - 35 = 39. The answer is 39."),
    ("Olivia has $23. She bought five bagels for $3 each. How much money does she have left?",
     "Olivia had 23 dollars. 5 bagels for 3 dollars each will be 5 x 3 = 15 dollars. "
     "So she has 23 - 15 dollars left. 23 - 15 is 8. The answer is 8."),
]

ANS_RE = re.compile(r"The answer is\s*\$?(-?[\d,]*\.?\d+)")


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--num_samples", type=int, default=8)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--top_p", type=float, default=0.95)
    ap.add_argument("--max_new_tokens", type=int, default=384)
    ap.add_argument("--batch_size", type=int, default=4)
    ap.add_argument("--limit", type=int, default=None, help="random subset of the test split")
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--out", default="results/gsm8k")
    return ap.parse_args()


def set_seed(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


def build_prompt(question):
    shots = "".join(f"Q: {q}\nA: {a}\n\n" for q, a in FEWSHOT)
    return shots + f"Q: {question}\nA:"


def extract_answer(text):
    text = text.split("\n\nQ:")[0]
    m = ANS_RE.search(text)
    if not m:
        return None
    return m.group(1).replace(",", "").rstrip(".")


def gold_answer(solution):
    return solution.split("####")[-1].strip().replace(",", "")


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    device = torch.device("cuda", local_rank)

    # different sampling streams on every rank
    set_seed(args.seed + rank)

    tok = AutoTokenizer.from_pretrained(args.model, padding_side="left")
    tok.pad_token = tok.pad_token or tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16).to(device)
    model.eval()

    data = list(load_dataset("gsm8k", "main", split="test"))
    for i, ex in enumerate(data):
        ex["idx"] = i
    if args.limit and args.limit < len(data):
        data = random.sample(data, args.limit)
    shard = data[rank::world_size]
    if rank == 0:
        print(f"{len(data)} problems, ~{len(shard)} per rank, {args.num_samples} samples each")

    local_results = []
    for s in range(0, len(shard), args.batch_size):
        batch = shard[s : s + args.batch_size]
        prompts = [build_prompt(ex["question"]) for ex in batch]
        enc = tok(prompts, return_tensors="pt", padding=True).to(device)
        with torch.no_grad():
            out = model.generate(
                **enc,
                do_sample=True,
                temperature=args.temperature,
                top_p=args.top_p,
                num_return_sequences=args.num_samples,
                max_new_tokens=args.max_new_tokens,
                pad_token_id=tok.pad_token_id,
            )
        completions = tok.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
        for j, ex in enumerate(batch):
            samples = completions[j * args.num_samples : (j + 1) * args.num_samples]
            answers = [extract_answer(c) for c in samples]
            local_results.append(
                {
                    "idx": ex["idx"],
                    "gold": gold_answer(ex["answer"]),
                    "answers": answers,
                    "first_completion": samples[0],
                }
            )
        if rank == 0 and (s // args.batch_size) % 10 == 0:
            print(f"  {s + len(batch)}/{len(shard)}", flush=True)

    all_results = [None for _ in range(world_size)]
    dist.all_gather_object(all_results, local_results)

    if rank == 0:
        results = sorted([r for part in all_results for r in part], key=lambda r: r["idx"])
        n = len(results)
        pass1 = sum(r["answers"][0] == r["gold"] for r in results) / n
        maj = 0
        for r in results:
            votes = Counter(a for a in r["answers"] if a is not None)
            if votes and votes.most_common(1)[0][0] == r["gold"]:
                maj += 1
        metrics = {
            "model": args.model,
            "n": n,
            "num_samples": args.num_samples,
            "pass@1(first sample)": pass1,
            f"maj@{args.num_samples}": maj / n,
        }
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "samples.jsonl"), "w") as f:
            for r in results:
                f.write(json.dumps(r) + "\n")
        with open(os.path.join(args.out, "metrics.json"), "w") as f:
            json.dump(metrics, f, indent=2)
        print(json.dumps(metrics, indent=2))

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
