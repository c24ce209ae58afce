# -*- coding: utf-8 -*-
"""
大规模文本分类离线推理：每张卡处理一部分数据，写出各自的预测分片文件，
最后由 rank 0 合并、去重、排序并计算指标（如果输入里带标签）。

用法：
    torchrun --nproc_per_node=8 02_shard_infer_merge.py \
        --input /data/comments/test.jsonl --ckpt ./output/cls/best.pt \
        --model-name hfl/chinese-roberta-wwm-ext --output ./preds
"""
import argparse
import datetime
import glob
import json
import logging
import os
import time

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from tqdm import tqdm
from transformers import AutoModelForSequenceClassification, AutoTokenizer

logging.basicConfig(format="%(asctime)s %(levelname)s %(message)s", level=logging.INFO)
logger = logging.getLogger(__name__)


def get_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--input", required=True, help="jsonl，每行至少包含 text 字段")
    parser.add_argument("--ckpt", required=True, help="训练阶段保存的 state_dict")
    parser.add_argument("--model-name", default="hfl/chinese-roberta-wwm-ext")
    parser.add_argument("--num-labels", type=int, default=3)
    parser.add_argument("--max-len", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--output", default="./preds")
    parser.add_argument("--keep-parts", action="store_true", help="合并后保留分片文件")
    return parser.parse_args()


class JsonlDataset(Dataset):
    def __init__(self, path):
        self.samples = []
        with open(path, encoding="utf-8") as f:
            for line in f:
                line = line.strip()
                if line:
                    self.samples.append(json.loads(line))

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, idx):
        s = self.samples[idx]
        return idx, s["text"], s.get("label", -1)


class Collator:
    def __init__(self, tokenizer, max_len):
        self.tokenizer = tokenizer
        self.max_len = max_len

    def __call__(self, batch):
        idxs, texts, labels = zip(*batch)
        enc = self.tokenizer(list(texts), padding=True, truncation=True,
                             max_length=self.max_len, return_tensors="pt")
        enc["idx"] = torch.tensor(idxs, dtype=torch.long)
        enc["labels"] = torch.tensor(labels, dtype=torch.long)
        return enc


def load_weights(model, ckpt_path):
    state = torch.load(ckpt_path, map_location="cpu")
    if "model" in state:
        state = state["model"]
    # 训练时用 DDP 包过一层，这里去掉 module. 前缀
    state = {k[len("module."):] if k.startswith("module.") else k: v for k, v in state.items()}
    model.load_state_dict(state, strict=True)
    return model


def merge_parts(output_dir, world_size, num_samples):
    """rank 0 调用：把所有分片读回来，按 idx 去重（DistributedSampler 末尾会补齐重复样本）。"""
    part_files = sorted(glob.glob(os.path.join(output_dir, "part-*.jsonl")))
    assert len(part_files) == world_size, f"分片数量不对: {len(part_files)} vs {world_size}"
    merged = {}
    for pf in part_files:
        with open(pf, encoding="utf-8") as f:
            for line in f:
                rec = json.loads(line)
                merged.setdefault(rec["idx"], rec)
    assert len(merged) == num_samples, f"合并后样本数 {len(merged)} != {num_samples}"
    return [merged[i] for i in range(num_samples)]


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    # 推理量大时 rank 0 合并较慢，把超时放宽
    dist.init_process_group("nccl", timeout=datetime.timedelta(hours=2))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")

    tokenizer = AutoTokenizer.from_pretrained(args.model_name)
    model = AutoModelForSequenceClassification.from_pretrained(args.model_name, num_labels=args.num_labels)
    model = load_weights(model, args.ckpt)
    model.to(device).eval()

    dataset = JsonlDataset(args.input)
    # shuffle=False + drop_last=False：每个 rank 拿到一样多的样本，末尾会补齐几条重复样本，合并时按 idx 去重
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=False, drop_last=False)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler,
                        num_workers=args.workers, collate_fn=Collator(tokenizer, args.max_len),
                        pin_memory=True)

    os.makedirs(args.output, exist_ok=True)
    part_path = os.path.join(args.output, f"part-{rank:05d}.jsonl")
    t0 = time.time()
    n_written = 0
    with open(part_path, "w", encoding="utf-8") as fout, torch.inference_mode():
        for batch in tqdm(loader, disable=rank != 0, desc="推理中"):
            idx = batch.pop("idx")
            labels = batch.pop("labels")
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            with torch.autocast("cuda", dtype=torch.float16):
                logits = model(**batch).logits
            probs = torch.softmax(logits.float(), dim=-1).cpu()
            preds = probs.argmax(dim=-1)
            for i in range(idx.size(0)):
                fout.write(json.dumps({
                    "idx": int(idx[i]),
                    "pred": int(preds[i]),
                    "prob": [round(p, 5) for p in probs[i].tolist()],
                    "label": int(labels[i]),
                }, ensure_ascii=False) + "\n")
                n_written += 1
    logger.info("rank %d 写出 %d 条预测到 %s，耗时 %.1fs", rank, n_written, part_path, time.time() - t0)

    # 等所有 rank 的分片都写完再合并
    dist.barrier()

    if rank == 0:
        records = merge_parts(args.output, world_size, len(dataset))
        final_path = os.path.join(args.output, "predictions.jsonl")
        correct, labeled = 0, 0
        with open(final_path, "w", encoding="utf-8") as f:
            for rec in records:
                src = dataset.samples[rec["idx"]]
                out = {"id": src.get("id", rec["idx"]), "text": src["text"],
                       "pred": rec["pred"], "prob": rec["prob"]}
                f.write(json.dumps(out, ensure_ascii=False) + "\n")
                if rec["label"] >= 0:
                    labeled += 1
                    correct += int(rec["pred"] == rec["label"])
        logger.info("合并完成：%d 条 -> %s", len(records), final_path)
        if labeled:
            logger.info("带标签样本 %d 条，准确率 %.4f", labeled, correct / labeled)
        if not args.keep_parts:
            for pf in glob.glob(os.path.join(args.output, "part-*.jsonl")):
                os.remove(pf)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
