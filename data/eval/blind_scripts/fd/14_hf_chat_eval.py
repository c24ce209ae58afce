#!/usr/bin/env python
# MT-Bench style single-turn answer generation + judge-free heuristics
# (length, refusal rate), for quick regression checks of chat checkpoints.
#
#   torchrun --nproc_per_node=8 14_hf_chat_eval.py --model ckpts/chat-13b \
#       --questions data/mt_bench_questions.jsonl --out results/chat-13b
import argparse
import json
import logging
import os
import re
import time

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

log = logging.getLogger(__name__)

REFUSAL = re.compile(r"\b(I can't|I cannot|I'm sorry|As an AI|I am unable)\b", re.I)

TEMPERATURE_BY_CATEGORY = {
    "writing": 0.7,
    "roleplay": 0.7,
    "extraction": 0.0,
    "math": 0.0,
    "coding": 0.0,
    "reasoning": 0.0,
    "stem": 0.1,
    "humanities": 0.1,
}


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--questions", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--max_new_tokens", type=int, default=1024)
    ap.add_argument("--batch_size", type=int, default=8)
    ap.add_argument("--num_choices", type=int, default=1)
    return ap.parse_args()


def load_questions(path):
    qs = []
    with open(path) as f:
        for line in f:
            if line.strip():
                qs.append(json.loads(line))
    return qs


def chat_prompt(tokenizer, text):
    msgs = [{"role": "user", "content": text}]
    return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)


def run_batch(model, tokenizer, questions, temperature, max_new_tokens):
    prompts = [chat_prompt(tokenizer, q["turns"][0]) for q in questions]
    enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    enc = enc.to(model.device)
    gen_cfg = GenerationConfig(
        max_new_tokens=max_new_tokens,
        do_sample=temperature > 1e-4,
        temperature=temperature if temperature > 1e-4 else None,
        top_p=0.95 if temperature > 1e-4 else None,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    with torch.no_grad():
        out = model.generate(**enc, generation_config=gen_cfg)
    return tokenizer.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)


def main():
    args = parse_args()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.ERROR,
                        format="%(asctime)s %(levelname)s %(message)s")

    tokenizer = AutoTokenizer.from_pretrained(args.model, padding_side="left")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token

    model = AutoModelForCausalLM.from_pretrained(
        args.model,
        torch_dtype=torch.bfloat16,
        device_map="auto",
        low_cpu_mem_usage=True,
    )
    model.eval()
    log.info("model loaded: %s", args.model)

    questions = load_questions(args.questions)
    mine = questions[rank::world]

    # group by category so every batch shares one temperature
    by_cat = {}
    for q in mine:
        by_cat.setdefault(q.get("category", "writing"), []).append(q)

    answers = []
    t0 = time.time()
    for cat, qs in sorted(by_cat.items()):
        temperature = TEMPERATURE_BY_CATEGORY.get(cat, 0.7)
        for choice in range(args.num_choices):
            torch.manual_seed(choice)
            for s in range(0, len(qs), args.batch_size):
                chunk = qs[s : s + args.batch_size]
                outs = run_batch(model, tokenizer, chunk, temperature, args.max_new_tokens)
                for q, o in zip(chunk, outs):
                    answers.append({"question_id": q["question_id"], "category": cat,
                                    "choice": choice, "answer": o.strip()})
        log.info("category %s done (%.0fs)", cat, time.time() - t0)

    gathered = [None] * world
    dist.all_gather_object(gathered, answers)

    if rank == 0:
        allans = sorted((a for g in gathered for a in g),
                        key=lambda a: (a["question_id"], a["choice"]))
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "answers.jsonl"), "w") as f:
            for a in allans:
                f.write(json.dumps(a) + "\n")

        stats = {}
        for a in allans:
            s = stats.setdefault(a["category"], {"n": 0, "chars": 0, "refusals": 0})
            s["n"] += 1
            s["chars"] += len(a["answer"])
            s["refusals"] += int(bool(REFUSAL.search(a["answer"])))
        summary = {
            cat: {"n": s["n"], "avg_chars": s["chars"] / s["n"], "refusal_rate": s["refusals"] / s["n"]}
            for cat, s in stats.items()
        }
        summary["_overall"] = {
            "n": len(allans),
            "refusal_rate": sum(s["refusals"] for s in stats.values()) / max(len(allans), 1),
            "seconds": round(time.time() - t0, 1),
        }
        with open(os.path.join(args.out, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
        log.info("wrote %d answers; overall refusal rate %.3f", len(allans),
                 summary["_overall"]["refusal_rate"])

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
