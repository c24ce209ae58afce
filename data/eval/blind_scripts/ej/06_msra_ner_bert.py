# -*- coding: utf-8 -*-
"""
MSRA NER (PER / LOC / ORG)，BERT + softmax 逐字分类
数据为 BIO 格式，每行 "字 标签"，空行分句。

启动:
    torchrun --nproc_per_node=4 06_msra_ner_bert.py \
        --bert_path /home/nlp/models/bert-base-chinese --data_dir ./data/msra --save_dir ./ckpt/msra
"""
import argparse
import logging
import os
import random

import numpy as np
import torch
import torch.distributed as dist
from seqeval.metrics import classification_report, f1_score
from torch.nn.parallel import DistributedDataParallel
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from tqdm import tqdm
from transformers import AutoTokenizer, BertForTokenClassification, get_linear_schedule_with_warmup

LABELS = ["O", "B-PER", "I-PER", "B-LOC", "I-LOC", "B-ORG", "I-ORG"]
L2I = {l: i for i, l in enumerate(LABELS)}
IGNORE = -100

log = logging.getLogger("msra")


def cli():
    p = argparse.ArgumentParser()
    p.add_argument("--bert_path", required=True)
    p.add_argument("--data_dir", required=True)
    p.add_argument("--save_dir", required=True)
    p.add_argument("--max_len", type=int, default=128)
    p.add_argument("--batch_size", type=int, default=32)
    p.add_argument("--lr", type=float, default=5e-5)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--seed", type=int, default=7)
    return p.parse_args()


def read_bio(path):
    sents, chars, tags = [], [], []
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line:
                if chars:
                    sents.append((chars, tags))
                    chars, tags = [], []
                continue
            c, t = line.split()
            chars.append(c)
            tags.append(t)
    if chars:
        sents.append((chars, tags))
    return sents


class MsraDataset(Dataset):
    def __init__(self, sents, tokenizer, max_len):
        self.items = []
        for chars, tags in sents:
            # 长句按 max_len 切块，防止实体被截掉太多
            for s in range(0, len(chars), max_len - 2):
                c = chars[s: s + max_len - 2]
                t = tags[s: s + max_len - 2]
                ids = tokenizer.convert_tokens_to_ids(["[CLS]"] + c + ["[SEP]"])
                labs = [IGNORE] + [L2I[x] for x in t] + [IGNORE]
                self.items.append((torch.tensor(ids), torch.tensor(labs)))

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def collate(batch):
    ids, labs = zip(*batch)
    ids = pad_sequence(ids, batch_first=True, padding_value=0)
    labs = pad_sequence(labs, batch_first=True, padding_value=IGNORE)
    return ids, (ids != 0).long(), labs


@torch.no_grad()
def evaluate(model, loader, device, world_size):
    model.eval()
    y_true, y_pred = [], []
    for ids, mask, labs in loader:
        ids, mask, labs = ids.to(device), mask.to(device), labs.to(device)
        pred = model(input_ids=ids, attention_mask=mask).logits.argmax(-1)
        # 汇总各卡的预测结果
        gathered_pred = [torch.zeros_like(pred) for _ in range(world_size)]
        gathered_labs = [torch.zeros_like(labs) for _ in range(world_size)]
        dist.all_gather(gathered_pred, pred)
        dist.all_gather(gathered_labs, labs)
        for p_batch, l_batch in zip(gathered_pred, gathered_labs):
            for p, l in zip(p_batch.tolist(), l_batch.tolist()):
                keep = [i for i, x in enumerate(l) if x != IGNORE]
                y_true.append([LABELS[l[i]] for i in keep])
                y_pred.append([LABELS[p[i]] for i in keep])
    model.train()
    return y_true, y_pred


def main():
    args = cli()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s | %(levelname)s | %(message)s")
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)

    tok = AutoTokenizer.from_pretrained(args.bert_path)
    train_ds = MsraDataset(read_bio(os.path.join(args.data_dir, "train.txt")), tok, args.max_len)
    test_ds = MsraDataset(read_bio(os.path.join(args.data_dir, "test.txt")), tok, args.max_len)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    test_sampler = DistributedSampler(test_ds, shuffle=False)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                          collate_fn=collate, num_workers=2, pin_memory=True)
    test_dl = DataLoader(test_ds, batch_size=64, sampler=test_sampler, collate_fn=collate)

    model = BertForTokenClassification.from_pretrained(
        args.bert_path, num_labels=len(LABELS),
        id2label=dict(enumerate(LABELS)), label2id=L2I,
    ).to(device)
    model = DistributedDataParallel(model, device_ids=[local_rank])

    optim = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    total = len(train_dl) * args.epochs
    sched = get_linear_schedule_with_warmup(optim, int(0.1 * total), total)

    log.info("train=%d test=%d world_size=%d steps=%d", len(train_ds), len(test_ds), world_size, total)
    best = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        bar = tqdm(train_dl, disable=rank != 0, desc=f"epoch {epoch}")
        for ids, mask, labs in bar:
            ids, mask, labs = ids.to(device), mask.to(device), labs.to(device)
            out = model(input_ids=ids, attention_mask=mask, labels=labs)
            out.loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optim.step()
            sched.step()
            optim.zero_grad()
            bar.set_postfix(loss=f"{out.loss.item():.4f}")

        y_true, y_pred = evaluate(model.module, test_dl, device, world_size)
        if rank == 0:
            f1 = f1_score(y_true, y_pred)
            log.info("epoch %d test F1 = %.4f", epoch, f1)
            log.info("\n%s", classification_report(y_true, y_pred, digits=4))
            if f1 > best:
                best = f1
                os.makedirs(args.save_dir, exist_ok=True)
                model.module.save_pretrained(args.save_dir)
                tok.save_pretrained(args.save_dir)
        dist.barrier()

    log.info("best F1 %.4f", best)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
