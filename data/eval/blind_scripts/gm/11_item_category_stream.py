# -*- coding: utf-8 -*-
"""
商品标题 -> 叶子类目 预测（TextCNN），样本为 OSS 上按天导出的 jsonl 分片

各 rank 按文件切分流式读取。分片大小不一致，各 rank 能读出的 batch 数不同，
所以每个 epoch 先根据导出任务写的 _manifest.json（每个分片的行数）算出各 rank 的样本数，
all_reduce 取最小值，所有 rank 跑同样的步数。

启动：
    torchrun --nproc_per_node=8 11_item_category_stream.py --conf conf/item_cate.yaml
"""
import os
import json
import time
import argparse
import logging

import yaml
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import IterableDataset, DataLoader, get_worker_info

from mall_ai.monitor import push_metrics

logger = logging.getLogger("item_cate")


def load_vocab(path):
    vocab = {"[PAD]": 0, "[UNK]": 1}
    with open(path, encoding="utf-8") as f:
        for line in f:
            w = line.rstrip("\n")
            if w and w not in vocab:
                vocab[w] = len(vocab)
    return vocab


class TitleStream(IterableDataset):
    def __init__(self, files, vocab, cate2id, max_len=48, batch_size=512):
        super().__init__()
        self.files, self.vocab, self.cate2id = files, vocab, cate2id
        self.max_len, self.batch_size = max_len, batch_size

    def _encode(self, title):
        ids = [self.vocab.get(ch, 1) for ch in title[: self.max_len]]
        return ids + [0] * (self.max_len - len(ids))

    def __iter__(self):
        info = get_worker_info()
        files = self.files if info is None else self.files[info.id::info.num_workers]
        buf_x, buf_y = [], []
        for path in files:
            with open(path, encoding="utf-8") as f:
                for line in f:
                    d = json.loads(line)
                    buf_x.append(self._encode(d["title"]))
                    buf_y.append(self.cate2id.get(d["cate_id"], 0))  # 0: 其他
                    if len(buf_x) == self.batch_size:
                        yield torch.tensor(buf_x), torch.tensor(buf_y)
                        buf_x, buf_y = [], []
        if buf_x:
            yield torch.tensor(buf_x), torch.tensor(buf_y)


class TextCNN(nn.Module):
    def __init__(self, vocab_size, num_classes, emb_dim=256, kernels=(2, 3, 4, 5), channels=256, dropout=0.3):
        super().__init__()
        self.emb = nn.Embedding(vocab_size, emb_dim, padding_idx=0)
        self.convs = nn.ModuleList([nn.Conv1d(emb_dim, channels, k) for k in kernels])
        self.drop = nn.Dropout(dropout)
        self.fc = nn.Linear(channels * len(kernels), num_classes)

    def forward(self, x):
        e = self.emb(x).transpose(1, 2)
        h = torch.cat([F.relu(c(e)).max(dim=2).values for c in self.convs], dim=1)
        return self.fc(self.drop(h))


@torch.no_grad()
def evaluate(model, files, vocab, cate2id, device):
    rank, world = dist.get_rank(), dist.get_world_size()
    model.eval()
    loader = DataLoader(TitleStream(files[rank::world], vocab, cate2id), batch_size=None, num_workers=2)
    stat = torch.zeros(3, device=device)  # top1, top5, n
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        top5 = model.module(x).topk(5, dim=1).indices
        stat[0] += (top5[:, 0] == y).sum()
        stat[1] += (top5 == y.unsqueeze(1)).any(dim=1).sum()
        stat[2] += y.numel()
    dist.all_reduce(stat)
    model.train()
    return (stat[0] / stat[2]).item(), (stat[1] / stat[2]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--conf", required=True)
    cfg = yaml.safe_load(open(ap.parse_args().conf, encoding="utf-8"))

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(message)s")

    # 词表和类目表都是固定文件，所有 rank 读到的一致
    vocab = load_vocab(cfg["vocab_file"])
    with open(cfg["cate_file"], encoding="utf-8") as f:
        cate2id = {line.strip(): i for i, line in enumerate(f) if line.strip()}
    with open(os.path.join(cfg["train_dir"], "_manifest.json"), encoding="utf-8") as f:
        row_counts = json.load(f)  # {文件名: 行数}
    train_files = sorted(os.path.join(cfg["train_dir"], n) for n in row_counts)
    val_files = sorted(os.path.join(cfg["val_dir"], n) for n in os.listdir(cfg["val_dir"]) if n.endswith(".jsonl"))
    logger.info("vocab %d, 类目 %d, 训练分片 %d", len(vocab), len(cate2id), len(train_files))

    model = TextCNN(len(vocab), len(cate2id), cfg["emb_dim"]).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=cfg["lr"])
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=cfg.get("lr_decay", 0.8))

    start_epoch = 0
    ckpt_path = os.path.join(cfg["ckpt_dir"], "latest.pt")
    if os.path.exists(ckpt_path):
        # 保存时张量在 cuda:0 上，映射到本 rank 的卡
        state = torch.load(ckpt_path, map_location={"cuda:0": f"cuda:{local_rank}"})
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        start_epoch = state["epoch"] + 1
        logger.info("resume from epoch %d", start_epoch)

    for epoch in range(start_epoch, cfg["epochs"]):
        # 每个 epoch 换一下文件分配，避免某个 rank 一直读同一批分片
        g = torch.Generator().manual_seed(cfg["seed"] + epoch)
        perm = torch.randperm(len(train_files), generator=g).tolist()
        my_files = [train_files[i] for i in perm][rank::world]
        local_rows = torch.tensor([sum(row_counts[os.path.basename(p)] for p in my_files)], device=device)
        dist.all_reduce(local_rows, op=dist.ReduceOp.MIN)
        # 每个 worker 末尾可能产出不满的 batch，按整 batch 向下取整一定不会超过任何 rank 的实际 batch 数
        steps_this_epoch = int(local_rows.item()) // cfg["batch_size"]
        loader = DataLoader(TitleStream(my_files, vocab, cate2id, batch_size=cfg["batch_size"]),
                            batch_size=None, num_workers=cfg["num_workers"], pin_memory=True)
        logger.info("epoch %d 各 rank 统一步数 %d", epoch, steps_this_epoch)
        model.train()
        n_steps, t0 = 0, time.time()
        for x, y in loader:
            if n_steps >= steps_this_epoch:
                break
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.cross_entropy(model(x), y, label_smoothing=0.1)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            n_steps += 1
            if rank == 0 and n_steps % 200 == 0:
                logger.info("epoch %d step %d/%d loss(rank0) %.4f %.1f step/s", epoch, n_steps, steps_this_epoch,
                            loss.item(), 200 / (time.time() - t0))
                t0 = time.time()
        scheduler.step()

        top1, top5 = evaluate(model, val_files, vocab, cate2id, device)
        if rank == 0:
            logger.info("epoch %d val top1 %.4f top5 %.4f", epoch, top1, top5)
            push_metrics("item_cate", {"val_top1": top1, "val_top5": top5}, step=epoch)
            os.makedirs(cfg["ckpt_dir"], exist_ok=True)
            tmp = ckpt_path + ".tmp"
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(), "epoch": epoch}, tmp)
            os.replace(tmp, ckpt_path)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
