# -*- coding: utf-8 -*-
"""
短视频推荐召回：SASRec 序列模型（next-item 预测）

用户行为序列离线处理成 npy：seq[N, max_len]（左侧 0 填充），物品 id 从 1 开始。
训练任务经常被抢占，所以每隔 save_steps 存一次 checkpoint 到 NAS，重启时 --resume 续训。

启动：
    torchrun --nproc_per_node=8 13_sasrec_next_item.py --config conf/sasrec_video.yaml --resume auto
"""
import os
import glob
import time
import argparse
import logging

import yaml
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import Dataset, DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler

log = logging.getLogger("sasrec")


class SeqDataset(Dataset):
    def __init__(self, path, num_items, train=True):
        self.seq = np.load(path, mmap_mode="r")
        self.num_items = num_items
        self.train = train

    def __len__(self):
        return self.seq.shape[0]

    def __getitem__(self, i):
        s = np.asarray(self.seq[i], dtype=np.int64)
        if self.train:
            inp, pos = s[:-1], s[1:]
            neg = np.random.randint(1, self.num_items + 1, size=pos.shape)
            neg[pos == 0] = 0
            return torch.from_numpy(inp), torch.from_numpy(pos), torch.from_numpy(neg)
        # 验证：最后一个物品作为目标，采样 100 个负样本
        cands = np.concatenate([[s[-1]], np.random.randint(1, self.num_items + 1, size=100)])
        return torch.from_numpy(s[:-1]), torch.from_numpy(cands)


class SASRec(nn.Module):
    def __init__(self, num_items, max_len, dim=64, heads=2, layers=2, dropout=0.2):
        super().__init__()
        self.item_emb = nn.Embedding(num_items + 1, dim, padding_idx=0)
        self.pos_emb = nn.Embedding(max_len, dim)
        self.drop = nn.Dropout(dropout)
        enc_layer = nn.TransformerEncoderLayer(dim, heads, dim * 4, dropout, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(enc_layer, layers)
        self.norm = nn.LayerNorm(dim)
        self.register_buffer("causal", torch.triu(torch.ones(max_len, max_len, dtype=torch.bool), 1), persistent=False)

    def forward(self, seq):
        L = seq.size(1)
        pos = torch.arange(L, device=seq.device).unsqueeze(0)
        x = self.drop(self.item_emb(seq) * (self.item_emb.embedding_dim ** 0.5) + self.pos_emb(pos))
        x = self.encoder(x, mask=self.causal[:L, :L], src_key_padding_mask=(seq == 0))
        return self.norm(x)  # B, L, D


def bce_loss(h, pos, neg, item_emb):
    pos_logit = (h * item_emb(pos)).sum(-1)
    neg_logit = (h * item_emb(neg)).sum(-1)
    mask = (pos != 0).float()
    loss = F.binary_cross_entropy_with_logits(pos_logit, torch.ones_like(pos_logit), reduction="none") + \
        F.binary_cross_entropy_with_logits(neg_logit, torch.zeros_like(neg_logit), reduction="none")
    return (loss * mask).sum() / mask.sum().clamp(min=1)


@torch.no_grad()
def evaluate(model, dataset, device, bs, k=10):
    rank, world = dist.get_rank(), dist.get_world_size()
    net = model.module
    net.eval()
    loader = DataLoader(Subset(dataset, range(rank, len(dataset), world)), batch_size=bs, num_workers=4)
    res = torch.zeros(3, device=device)  # hr, ndcg, n
    for seq, cands in loader:
        seq, cands = seq.to(device), cands.to(device)
        h = net(seq)[:, -1]                                   # B, D
        scores = (net.item_emb(cands) * h.unsqueeze(1)).sum(-1)  # B, 101
        rank_pos = (scores[:, 1:] > scores[:, :1]).sum(1)      # 目标的名次（0 开始）
        hit = rank_pos < k
        res[0] += hit.sum()
        res[1] += (hit.float() / torch.log2(rank_pos.float() + 2)).sum()
        res[2] += seq.size(0)
    dist.all_reduce(res)
    net.train()
    return (res[0] / res[2]).item(), (res[1] / res[2]).item()


def find_latest(ckpt_dir):
    files = glob.glob(os.path.join(ckpt_dir, "step_*.pt"))
    if not files:
        return None
    return max(files, key=lambda f: int(os.path.basename(f)[5:-3]))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--resume", default="", help="checkpoint 路径，auto 表示自动找最新")
    args = ap.parse_args()
    cfg = yaml.safe_load(open(args.config))

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(message)s")
    np.random.seed(cfg["seed"] + rank)  # 负采样每个 rank 不同
    torch.manual_seed(cfg["seed"])

    train_set = SeqDataset(cfg["train_seq"], cfg["num_items"], train=True)
    val_set = SeqDataset(cfg["val_seq"], cfg["num_items"], train=False)
    sampler = DistributedSampler(train_set, shuffle=True, seed=cfg["seed"])
    loader = DataLoader(train_set, batch_size=cfg["batch_size"], sampler=sampler, num_workers=8,
                        pin_memory=True, drop_last=True, persistent_workers=True)

    model = SASRec(cfg["num_items"], cfg["max_len"] - 1, cfg["dim"], cfg["heads"], cfg["layers"], cfg["dropout"])
    model = DDP(model.to(device), device_ids=[local_rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=cfg["lr"], betas=(0.9, 0.98))

    start_epoch, step = 0, 0
    resume = find_latest(cfg["ckpt_dir"]) if args.resume == "auto" else args.resume
    if resume:
        checkpoint = torch.load(resume)
        model.module.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        start_epoch, step = checkpoint["epoch"], checkpoint["step"]
        del checkpoint
        log.info("从 %s 恢复: epoch %d step %d", resume, start_epoch, step)

    steps_per_epoch = len(loader)
    for epoch in range(start_epoch, cfg["epochs"]):
        sampler.set_epoch(epoch)
        skip = step - epoch * steps_per_epoch if step > epoch * steps_per_epoch else 0
        t0 = time.time()
        for i, (seq, pos, neg) in enumerate(loader):
            if i < skip:
                continue  # 续训时跳过本 epoch 已经训练过的 batch（所有 rank 跳过的数量相同）
            seq, pos, neg = seq.to(device, non_blocking=True), pos.to(device, non_blocking=True), neg.to(device, non_blocking=True)
            h = model(seq)
            loss = bce_loss(h, pos, neg, model.module.item_emb)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1
            if step % cfg["log_every"] == 0:
                log.info("epoch %d step %d loss %.4f %.1f it/s", epoch, step, loss.item(),
                         cfg["log_every"] / (time.time() - t0))
                t0 = time.time()
            if step % cfg["save_steps"] == 0 and rank == 0:
                os.makedirs(cfg["ckpt_dir"], exist_ok=True)
                path = os.path.join(cfg["ckpt_dir"], "step_%d.pt" % step)
                torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                            "epoch": epoch, "step": step}, path + ".tmp")
                os.replace(path + ".tmp", path)

        hr, ndcg = evaluate(model, val_set, device, cfg["batch_size"])
        log.info("epoch %d HR@10 %.4f NDCG@10 %.4f", epoch, hr, ndcg)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
