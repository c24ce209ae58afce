# -*- coding: utf-8 -*-
"""
C3 中文多项选择阅读理解：RoBERTa-wwm-ext 多卡微调 + 每轮 dev 准确率评估。
特征（tokenize 后的张量）会缓存到 cache_dir，第二次启动直接加载，省去几分钟预处理。

torchrun --nproc_per_node=4 10_mc_qa_feature_cache.py --data-dir data/c3 --cache-dir cache/c3
"""
import argparse
import json
import logging
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler
from tqdm import tqdm
from transformers import AutoModelForMultipleChoice, AutoTokenizer, get_linear_schedule_with_warmup

logger = logging.getLogger("c3")
NUM_CHOICES = 4


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data-dir", required=True, help="包含 train.json / dev.json")
    ap.add_argument("--cache-dir", default="cache/c3")
    ap.add_argument("--model", default="hfl/chinese-roberta-wwm-ext")
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--grad-accum", type=int, default=4)
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--epochs", type=int, default=8)
    ap.add_argument("--output", default="output/c3_roberta")
    return ap.parse_args()


def read_c3(path):
    """C3 格式: [[段落列表], [{question, choice, answer}], id]"""
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    examples = []
    for doc, qas, _ in data:
        context = "".join(doc)
        for qa in qas:
            choices = qa["choice"][:NUM_CHOICES]
            label = choices.index(qa["answer"])
            while len(choices) < NUM_CHOICES:
                choices.append("无效答案")
            examples.append((context, qa["question"], choices, label))
    return examples


def convert_to_features(examples, tokenizer, max_len):
    all_ids, all_mask, all_type, all_label = [], [], [], []
    for context, question, choices, label in tqdm(examples, desc="构造特征"):
        firsts = [context] * NUM_CHOICES
        seconds = [question + "[SEP]" + c for c in choices]
        enc = tokenizer(firsts, seconds, truncation="only_first", max_length=max_len, padding="max_length")
        all_ids.append(enc["input_ids"])
        all_mask.append(enc["attention_mask"])
        all_type.append(enc["token_type_ids"])
        all_label.append(label)
    return {"input_ids": torch.tensor(all_ids), "attention_mask": torch.tensor(all_mask),
            "token_type_ids": torch.tensor(all_type), "labels": torch.tensor(all_label)}


def to_dataset(feats):
    return TensorDataset(feats["input_ids"], feats["attention_mask"], feats["token_type_ids"], feats["labels"])


def load_features(split, args, tokenizer):
    os.makedirs(args.cache_dir, exist_ok=True)
    cache_file = os.path.join(args.cache_dir, f"{split}_{os.path.basename(args.model)}_{args.max_len}.pt")
    if os.path.exists(cache_file):
        logger.info("从缓存加载特征: %s", cache_file)
        return to_dataset(torch.load(cache_file))
    examples = read_c3(os.path.join(args.data_dir, f"{split}.json"))
    feats = convert_to_features(examples, tokenizer, args.max_len)
    torch.save(feats, cache_file)
    logger.info("特征已缓存到 %s，共 %d 条", cache_file, len(examples))
    return to_dataset(feats)


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    stats = torch.zeros(2, device=device)
    for ids, mask, tt, labels in loader:
        logits = model(input_ids=ids.to(device), attention_mask=mask.to(device),
                       token_type_ids=tt.to(device)).logits
        stats[0] += (logits.argmax(-1) == labels.to(device)).sum()
        stats[1] += labels.size(0)
    dist.all_reduce(stats)
    return (stats[0] / stats[1]).item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s [%(levelname)s] %(message)s")

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    train_set = load_features("train", args, tokenizer)
    dev_set = load_features("dev", args, tokenizer)

    train_sampler = DistributedSampler(train_set, shuffle=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=2, pin_memory=True, drop_last=True)
    # dev 按 rank 切片，不补齐，保证准确率分母正确
    dev_idx = list(range(rank, len(dev_set), world))
    dev_loader = DataLoader(torch.utils.data.Subset(dev_set, dev_idx), batch_size=16,
                            num_workers=2, pin_memory=True)

    model = AutoModelForMultipleChoice.from_pretrained(args.model).to(device)
    model = DDP(model, device_ids=[local_rank])

    no_decay = ("bias", "LayerNorm.weight")
    params = [
        {"params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)],
         "weight_decay": 0.01},
        {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)],
         "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(params, lr=args.lr)
    total_updates = len(train_loader) // args.grad_accum * args.epochs
    scheduler = get_linear_schedule_with_warmup(optimizer, int(0.1 * total_updates), total_updates)
    logger.info("train=%d dev=%d 每卡 batch=%d 梯度累积=%d 卡数=%d", len(train_set), len(dev_set),
                args.batch_size, args.grad_accum, world)

    best = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        for step, (ids, mask, tt, labels) in enumerate(train_loader):
            is_update = (step + 1) % args.grad_accum == 0
            ctx = model.no_sync() if not is_update else torch.enable_grad()
            with ctx:
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    out = model(input_ids=ids.to(device), attention_mask=mask.to(device),
                                token_type_ids=tt.to(device), labels=labels.to(device))
                (out.loss / args.grad_accum).backward()
            if is_update:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
            if rank == 0 and step % 200 == 0:
                logger.info("epoch %d step %d/%d loss %.4f", epoch, step, len(train_loader), out.loss.item())

        acc = evaluate(model.module, dev_loader, device)
        logger.info("epoch %d dev acc = %.4f", epoch, acc)
        if rank == 0 and acc > best:
            best = acc
            os.makedirs(args.output, exist_ok=True)
            model.module.save_pretrained(args.output)
            tokenizer.save_pretrained(args.output)
            logger.info("新的最优模型已保存 (acc=%.4f)", best)
        dist.barrier()

    logger.info("训练结束，最优 dev acc = %.4f", best)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
