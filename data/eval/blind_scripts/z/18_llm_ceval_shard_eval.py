# -*- coding: utf-8 -*-
"""
C-Eval / CMMLU 风格的选择题评测（5-shot），多卡数据并行：每个进程加载一份模型，
负责一部分题目，最后 rank 0 汇总各学科准确率。

torchrun --nproc_per_node=8 18_llm_ceval_shard_eval.py \
    --model /models/Qwen2-7B-Instruct --data-dir data/ceval/val --dev-dir data/ceval/dev --out results/qwen2_7b
"""
import argparse
import glob
import json
import os
import time
from collections import defaultdict

import pandas as pd
import torch
import torch.distributed as dist
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer

CHOICES = ["A", "B", "C", "D"]


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--data-dir", required=True, help="每个学科一个 {subject}_val.csv")
    ap.add_argument("--dev-dir", required=True, help="few-shot 示例 {subject}_dev.csv")
    ap.add_argument("--shots", type=int, default=5)
    ap.add_argument("--max-len", type=int, default=4096)
    ap.add_argument("--out", default="results/ceval")
    return ap.parse_args()


def format_example(row, with_answer=True):
    s = row["question"].strip() + "\n"
    for c in CHOICES:
        s += f"{c}. {str(row[c]).strip()}\n"
    s += "答案："
    if with_answer:
        s += f"{row['answer']}\n\n"
    return s


def build_prompt(subject_zh, dev_df, row, shots):
    prompt = f"以下是中国关于{subject_zh}考试的单项选择题，请选出其中的正确答案。\n\n"
    for _, d in dev_df.head(shots).iterrows():
        prompt += format_example(d, with_answer=True)
    return prompt + format_example(row, with_answer=False)


def load_tasks(args):
    tasks = []
    for path in sorted(glob.glob(os.path.join(args.data_dir, "*_val.csv"))):
        subject = os.path.basename(path)[: -len("_val.csv")]
        val_df = pd.read_csv(path)
        dev_df = pd.read_csv(os.path.join(args.dev_dir, f"{subject}_dev.csv"))
        for qi, row in val_df.iterrows():
            tasks.append((subject, qi, row, dev_df))
    return tasks


@torch.no_grad()
def score_one(model, tok, prompt, choice_ids, max_len):
    enc = tok(prompt, return_tensors="pt")
    input_ids = enc["input_ids"][:, -max_len:].to(model.device)
    logits = model(input_ids=input_ids).logits[0, -1]
    choice_logits = logits[choice_ids].float()
    return int(choice_logits.argmax().item()), torch.softmax(choice_logits, -1).tolist()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()

    tok = AutoTokenizer.from_pretrained(args.model, trust_remote_code=True)
    model = AutoModelForCausalLM.from_pretrained(
        args.model,
        torch_dtype=torch.bfloat16,
        device_map="auto",
        trust_remote_code=True,
    ).eval()
    # 选项字母对应的 token id（取 "A" 等单独编码后的最后一个 token）
    choice_ids = [tok.encode(c, add_special_tokens=False)[-1] for c in CHOICES]

    tasks = load_tasks(args)
    my_tasks = tasks[rank::world_size]
    if rank == 0:
        print(f"共 {len(tasks)} 道题，{world_size} 个进程，每个进程约 {len(my_tasks)} 道", flush=True)

    subject_names = {}
    name_file = os.path.join(os.path.dirname(args.data_dir.rstrip("/")), "subject_mapping.json")
    if os.path.exists(name_file):
        with open(name_file, encoding="utf-8") as f:
            subject_names = {k: v[1] for k, v in json.load(f).items()}

    t0 = time.time()
    local_records = []
    for subject, qi, row, dev_df in tqdm(my_tasks, disable=rank != 0, desc="评测中"):
        prompt = build_prompt(subject_names.get(subject, subject), dev_df, row, args.shots)
        pred, probs = score_one(model, tok, prompt, choice_ids, args.max_len)
        local_records.append({
            "subject": subject, "id": int(qi), "pred": CHOICES[pred],
            "answer": row["answer"], "probs": [round(p, 4) for p in probs],
        })
    print(f"[rank {rank}] 完成 {len(local_records)} 道题，用时 {time.time() - t0:.0f}s", flush=True)

    gathered = [None] * world_size
    dist.all_gather_object(gathered, local_records)

    if rank == 0:
        records = [r for part in gathered for r in part]
        assert len(records) == len(tasks)
        per_subject = defaultdict(lambda: [0, 0])
        for r in records:
            per_subject[r["subject"]][0] += int(r["pred"] == r["answer"])
            per_subject[r["subject"]][1] += 1
        os.makedirs(args.out, exist_ok=True)
        summary = {s: round(c / n * 100, 2) for s, (c, n) in sorted(per_subject.items())}
        summary["_avg_subject"] = round(sum(summary.values()) / len(per_subject), 2)
        summary["_avg_question"] = round(sum(int(r["pred"] == r["answer"]) for r in records) / len(records) * 100, 2)
        with open(os.path.join(args.out, "predictions.jsonl"), "w", encoding="utf-8") as f:
            for r in sorted(records, key=lambda r: (r["subject"], r["id"])):
                f.write(json.dumps(r, ensure_ascii=False) + "\n")
        with open(os.path.join(args.out, "summary.json"), "w", encoding="utf-8") as f:
            json.dump(summary, f, ensure_ascii=False, indent=2)
        print(f"学科平均准确率 {summary['_avg_subject']:.2f}，题目平均准确率 {summary['_avg_question']:.2f}")

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
