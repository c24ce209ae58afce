# -*- coding: utf-8 -*-
"""
SMP2020-EWECT 微博情绪分类（6 类：积极/愤怒/悲伤/恐惧/惊奇/无情绪）
chinese-roberta-wwm-ext-large + DeepSpeed ZeRO-2 + fp16

单机 8 卡:
    deepspeed --num_gpus=8 20_ds_bert_cls.py --model_dir /models/chinese-roberta-wwm-ext-large \
        --data_dir /data/smp2020_ewect/usual --output_dir exp/ewect_large_ds
"""
import argparse
import json
import logging
import os
import random

import deepspeed
import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForSequenceClassification, AutoTokenizer

logger = logging.getLogger("ewect")

EMOTIONS = ["happy", "angry", "sad", "fear", "surprise", "neutral"]
EMO2ID = {e: i for i, e in enumerate(EMOTIONS)}

DS_CONFIG = {
    "train_batch_size": 128,
    "train_micro_batch_size_per_gpu": 16,
    "gradient_accumulation_steps": 2,
    "gradient_clipping": 1.0,
    "optimizer": {
        "type": "AdamW",
        "params": {"lr": 1e-5, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01},
    },
    "scheduler": {
        "type": "WarmupDecayLR",
        "params": {"warmup_min_lr": 0, "warmup_max_lr": 1e-5, "warmup_num_steps": 80,
                   "total_num_steps": 870},
    },
    "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000,
             "hysteresis": 2, "min_loss_scale": 1},
    "zero_optimization": {"stage": 2, "overlap_comm": True, "contiguous_gradients": True,
                          "reduce_bucket_size": 5e8, "allgather_bucket_size": 5e8},
    "steps_per_print": 200,
}


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model_dir", required=True)
    parser.add_argument("--data_dir", required=True)
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--max_len", type=int, default=140)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--seed", type=int, default=2020)
    parser.add_argument("--local_rank", type=int, default=-1, help="deepspeed 启动器传入")
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


class EwectDataset(Dataset):
    """usual_train.txt 是 json 列表: [{"id": 1, "content": "...", "label": "angry"}, ...]"""

    def __init__(self, path, tokenizer, max_len):
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        self.texts = [d["content"].strip() or "。" for d in data]
        self.labels = [EMO2ID[d["label"]] for d in data]
        self.tok = tokenizer
        self.max_len = max_len

    def __len__(self):
        return len(self.texts)

    def __getitem__(self, i):
        return self.texts[i], self.labels[i]

    def collate(self, batch):
        texts, labels = zip(*batch)
        enc = self.tok(list(texts), truncation=True, max_length=self.max_len, padding=True, return_tensors="pt")
        enc["labels"] = torch.tensor(labels, dtype=torch.long)
        return enc


@torch.no_grad()
def evaluate(engine, loader, device):
    engine.eval()
    # 混淆矩阵，用来算 macro-F1（比赛指标）
    cm = torch.zeros(len(EMOTIONS), len(EMOTIONS), device=device, dtype=torch.long)
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        logits = engine(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                        token_type_ids=batch["token_type_ids"]).logits
        pred = logits.argmax(-1)
        cm.index_put_((batch["labels"], pred), torch.ones_like(pred), accumulate=True)
    dist.all_reduce(cm)
    engine.train()
    cm = cm.double()
    prec = cm.diag() / cm.sum(0).clamp(min=1)
    rec = cm.diag() / cm.sum(1).clamp(min=1)
    f1 = 2 * prec * rec / (prec + rec).clamp(min=1e-8)
    return (cm.diag().sum() / cm.sum()).item(), f1.mean().item()


def main():
    args = parse_args()
    deepspeed.init_distributed(dist_backend="nccl")
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(message)s")
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)

    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    train_ds = EwectDataset(os.path.join(args.data_dir, "usual_train.txt"), tokenizer, args.max_len)
    dev_ds = EwectDataset(os.path.join(args.data_dir, "usual_eval_labeled.txt"), tokenizer, args.max_len)

    model = AutoModelForSequenceClassification.from_pretrained(args.model_dir, num_labels=len(EMOTIONS))
    engine, _, _, _ = deepspeed.initialize(
        args=args, model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
        config=DS_CONFIG,
    )

    micro_bs = DS_CONFIG["train_micro_batch_size_per_gpu"]
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    train_loader = DataLoader(train_ds, batch_size=micro_bs, sampler=train_sampler,
                              collate_fn=train_ds.collate, num_workers=4, pin_memory=True, drop_last=True)
    dev_loader = DataLoader(dev_ds, batch_size=64, collate_fn=dev_ds.collate,
                            sampler=DistributedSampler(dev_ds, shuffle=False, drop_last=True))

    logger.info("train %d | dev %d | world %d | micro bs %d", len(train_ds), len(dev_ds),
                dist.get_world_size(), micro_bs)
    best_f1 = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        engine.train()
        for step, batch in enumerate(train_loader):
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            loss = engine(**batch).loss
            engine.backward(loss)
            engine.step()
            if engine.is_gradient_accumulation_boundary() and engine.global_steps % 50 == 0:
                logger.info("epoch %d global_step %d loss %.4f lr %.2e", epoch, engine.global_steps,
                            loss.item(), engine.get_lr()[0])

        acc, macro_f1 = evaluate(engine, dev_loader, device)
        logger.info("epoch %d | dev acc %.4f | macro-F1 %.4f", epoch, acc, macro_f1)
        # save_checkpoint 是集合操作，所有 rank 都要调
        engine.save_checkpoint(args.output_dir, tag=f"epoch{epoch}", client_state={"macro_f1": macro_f1})
        if macro_f1 > best_f1:
            best_f1 = macro_f1
            if rank == 0:
                best_dir = os.path.join(args.output_dir, "best_hf")
                engine.module.save_pretrained(best_dir)
                tokenizer.save_pretrained(best_dir)
                logger.info("导出最优 HF 权重 macro-F1=%.4f -> %s", best_f1, best_dir)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
