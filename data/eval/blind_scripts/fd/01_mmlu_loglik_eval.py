#!/usr/bin/env python
"""Few-shot MMLU evaluation by next-token log-likelihood of the answer letter.

Launch with torchrun; every rank loads a full copy of the model and scores a
strided slice of the test questions.
"""
import argparse
import json
import logging
import os
import time
from collections import defaultdict

import torch
import torch.distributed as dist
import torch.nn.functional as F
from datasets import load_dataset
from transformers import AutoModelForCausalLM, AutoTokenizer

logger = logging.getLogger("mmlu")

CHOICES = ["A", "B", "C", "D"]


def parse_args():
    p = argparse.ArgumentParser(description="MMLU log-likelihood eval")
    p.add_argument("--model", required=True)
    p.add_argument("--dataset", default="cais/mmlu")
    p.add_argument("--subset", default="all")
    p.add_argument("--num_fewshot", type=int, default=5)
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--max_length", type=int, default=2048)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--output_dir", default="results/mmlu")
    p.add_argument("--limit", type=int, default=None, help="only score the first N questions")
    p.add_argument("--log_every", type=int, default=50)
    return p.parse_args()


def format_subject(subject):
    return " ".join(subject.split("_"))


def format_example(ex, include_answer=True):
    prompt = ex["question"].strip()
    for letter, choice in zip(CHOICES, ex["choices"]):
        prompt += f"\n{letter}. {choice}"
    prompt += "\nAnswer:"
    if include_answer:
        prompt += f" {CHOICES[ex['answer']]}\n\n"
    return prompt


def build_prompts(test_set, dev_set, k):
    dev_by_subject = defaultdict(list)
    for ex in dev_set:
        dev_by_subject[ex["subject"]].append(ex)

    prompts = []
    for i, ex in enumerate(test_set):
        subj = ex["subject"]
        header = (
            "The following are multiple choice questions (with answers) about "
            f"{format_subject(subj)}.\n\n"
        )
        shots = "".join(format_example(d) for d in dev_by_subject[subj][:k])
        prompts.append(
            {
                "idx": i,
                "subject": subj,
                "prompt": header + shots + format_example(ex, include_answer=False),
                "label": int(ex["answer"]),
            }
        )
    return prompts


@torch.no_grad()
def score_batch(model, tokenizer, batch, choice_ids, max_length, device):
    enc = tokenizer(
        [b["prompt"] for b in batch],
        return_tensors="pt",
        padding=True,
        truncation=True,
        max_length=max_length,
    )
    enc = {k: v.to(device) for k, v in enc.items()}
    logits = model(**enc).logits
    # left padding, so the last position holds the next-token distribution
    last = logits[:, -1, :].float()
    logprobs = F.log_softmax(last, dim=-1)[:, choice_ids]
    return logprobs.argmax(dim=-1).tolist()


def main():
    args = parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    device = torch.device("cuda", local_rank)

    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format=f"[rank{rank}] %(asctime)s %(levelname)s %(message)s",
    )

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    tokenizer.padding_side = "left"
    tokenizer.truncation_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token

    model = AutoModelForCausalLM.from_pretrained(
        args.model, torch_dtype=getattr(torch, args.dtype)
    ).to(device)
    model.eval()

    choice_ids = [tokenizer.encode(" " + c, add_special_tokens=False)[-1] for c in CHOICES]
    logger.info("choice token ids: %s", choice_ids)

    test_set = load_dataset(args.dataset, args.subset, split="test")
    dev_set = load_dataset(args.dataset, args.subset, split="dev")
    prompts = build_prompts(test_set, dev_set, args.num_fewshot)
    if args.limit:
        prompts = prompts[: args.limit]

    local = prompts[rank::world_size]
    num_batches = (len(local) + args.batch_size - 1) // args.batch_size
    logger.info("%d questions total, %d on rank 0 (%d batches)", len(prompts), len(local), num_batches)

    correct = defaultdict(int)
    total = defaultdict(int)
    t0 = time.time()
    for b, start in enumerate(range(0, len(local), args.batch_size)):
        batch = local[start : start + args.batch_size]
        preds = score_batch(model, tokenizer, batch, choice_ids, args.max_length, device)
        for ex, pred in zip(batch, preds):
            total[ex["subject"]] += 1
            correct[ex["subject"]] += int(pred == ex["label"])
        if b % args.log_every == 0:
            logger.info("batch %d/%d (%.1fs)", b, num_batches, time.time() - t0)

    dist.barrier()
    elapsed = time.time() - t0

    if rank == 0:
        per_subject = {s: correct[s] / total[s] for s in sorted(total)}
        macro = sum(per_subject.values()) / max(len(per_subject), 1)
        micro = sum(correct.values()) / max(sum(total.values()), 1)
        results = {
            "model": args.model,
            "num_fewshot": args.num_fewshot,
            "num_questions": len(prompts),
            "acc_micro": micro,
            "acc_macro": macro,
            "per_subject": per_subject,
            "world_size": world_size,
            "seconds": elapsed,
        }
        os.makedirs(args.output_dir, exist_ok=True)
        out_path = os.path.join(args.output_dir, "results.json")
        with open(out_path, "w") as f:
            json.dump(results, f, indent=2)
        logger.info("MMLU acc (micro) %.4f  (macro) %.4f  -> %s", micro, macro, out_path)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
