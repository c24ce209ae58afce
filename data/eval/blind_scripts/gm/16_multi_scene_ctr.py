# -*- coding: utf-8 -*-
"""
多场景 CTR 模型（首页 / 搜索结果页 / 详情页 / 购物车 4 个场景）

共享 embedding + 共享底层 MLP，每个场景一个独立 tower。
为了让同一 batch 走同一个 tower（方便按场景做 loss 加权），按场景分桶组 batch，
所以每一步只有一个 tower 参与前向 -> 其余 tower 没有梯度，
DDP 必须开 find_unused_parameters=True。

每天增量训练：用前一天的模型热启动。
启动：
    torchrun --nproc_per_node=8 16_multi_scene_ctr.py --conf conf/multi_scene.yaml --date 20240315
"""
import os
import math
import time
import random
import argparse
import logging

import yaml
import numpy as np
import torch
import torch.nn as nn
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import Dataset, DataLoader, Sampler
from torch.utils.tensorboard import SummaryWriter
from sklearn.metrics import roc_auc_score

logger = logging.getLogger("multi_scene")
SCENES = ["home", "search", "detail", "cart"]


class SceneDataset(Dataset):
    def __init__(self, npz_path):
        d = np.load(npz_path)
        self.sparse = d["sparse"].astype(np.int64)
        self.dense = d["dense"].astype(np.float32)
        self.scene = d["scene"].astype(np.int64)
        self.label = d["label"].astype(np.float32)

    def __len__(self):
        return len(self.label)

    def __getitem__(self, i):
        return self.sparse[i], self.dense[i], self.scene[i], self.label[i]


class DistributedSceneBatchSampler(Sampler):
    """按场景分桶组 batch，再把 batch 列表均匀分给各 rank。

    所有 rank 用相同的 seed + epoch 打乱，保证划分一致；batch 数补齐到 world_size 的整数倍，
    每个 rank 拿到的 batch 数相同。
    """

    def __init__(self, scenes, batch_size, rank, world_size, seed=0):
        self.buckets = [np.where(scenes == s)[0] for s in range(len(SCENES))]
        self.batch_size = batch_size
        self.rank, self.world_size = rank, world_size
        self.seed, self.epoch = seed, 0
        n_batches = sum(len(b) // batch_size for b in self.buckets)
        self.num_batches_per_rank = math.ceil(n_batches / world_size)

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        rng = np.random.RandomState(self.seed + self.epoch)
        batches = []
        for b in self.buckets:
            idx = rng.permutation(b)
            batches += [idx[i:i + self.batch_size] for i in range(0, len(idx) - self.batch_size + 1, self.batch_size)]
        order = rng.permutation(len(batches))
        batches = [batches[i] for i in order]
        total = self.num_batches_per_rank * self.world_size
        batches += batches[: total - len(batches)]
        return iter(batches[self.rank:total:self.world_size])

    def __len__(self):
        return self.num_batches_per_rank


class MultiSceneModel(nn.Module):
    def __init__(self, vocab_sizes, num_dense, emb_dim=16, shared=(512, 256), tower=(128, 64)):
        super().__init__()
        self.embs = nn.ModuleList([nn.Embedding(v, emb_dim) for v in vocab_sizes])
        layers, d = [], len(vocab_sizes) * emb_dim + num_dense
        for h in shared:
            layers += [nn.Linear(d, h), nn.ReLU()]
            d = h
        self.shared = nn.Sequential(*layers)
        self.towers = nn.ModuleList()
        for _ in SCENES:
            t, td = [], d
            for h in tower:
                t += [nn.Linear(td, h), nn.ReLU()]
                td = h
            t.append(nn.Linear(td, 1))
            self.towers.append(nn.Sequential(*t))

    def forward(self, sparse, dense, scene_id):
        emb = torch.cat([e(sparse[:, i]) for i, e in enumerate(self.embs)], dim=1)
        h = self.shared(torch.cat([emb, dense], dim=1))
        return self.towers[scene_id](h).squeeze(1)


@torch.no_grad()
def evaluate(model, dataset, device, bs):
    """每个场景分别算 AUC；各 rank 预测自己那一段，gather 后 rank0 计算"""
    rank, world = dist.get_rank(), dist.get_world_size()
    net = model.module
    net.eval()
    local = []
    for s in range(len(SCENES)):
        idx = np.where(dataset.scene == s)[0][rank::world]
        for i in range(0, len(idx), bs):
            j = idx[i:i + bs]
            sparse = torch.from_numpy(dataset.sparse[j]).to(device)
            dense = torch.from_numpy(dataset.dense[j]).to(device)
            local.append((s, torch.sigmoid(net(sparse, dense, s)).cpu().numpy(), dataset.label[j]))
    gathered = [None] * world if rank == 0 else None
    dist.gather_object(local, gathered, dst=0)
    net.train()
    if rank != 0:
        return None
    res = {}
    for s, name in enumerate(SCENES):
        p = np.concatenate([x[1] for g in gathered for x in g if x[0] == s] or [np.zeros(0)])
        y = np.concatenate([x[2] for g in gathered for x in g if x[0] == s] or [np.zeros(0)])
        res[name] = roc_auc_score(y, p) if 0 < y.sum() < len(y) else float("nan")
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--conf", required=True)
    ap.add_argument("--date", required=True)
    args = ap.parse_args()
    cfg = yaml.safe_load(open(args.conf))

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(message)s")
    random.seed(cfg["seed"])
    torch.manual_seed(cfg["seed"])

    model_dir = os.path.join(cfg["model_root"], args.date)
    writer = None
    if rank == 0:
        os.makedirs(model_dir, exist_ok=True)
        writer = SummaryWriter(os.path.join(cfg["tb_root"], args.date))

    train_set = SceneDataset(os.path.join(cfg["data_root"], args.date, "train.npz"))
    val_set = SceneDataset(os.path.join(cfg["data_root"], args.date, "val.npz"))
    batch_sampler = DistributedSceneBatchSampler(train_set.scene, cfg["batch_size"], rank, world, seed=cfg["seed"])
    loader = DataLoader(train_set, batch_sampler=batch_sampler, num_workers=4, pin_memory=True)

    model = MultiSceneModel(cfg["vocab_sizes"], train_set.dense.shape[1], cfg["emb_dim"]).to(device)
    # 热启动：前一天的模型（保存时已经去掉了 DDP 的 module. 前缀，老版本脚本存的带前缀，这里兼容一下）
    prev = cfg.get("warm_start")
    if prev and os.path.exists(prev):
        state = torch.load(prev, map_location="cpu")
        state = {k[len("module."):] if k.startswith("module.") else k: v for k, v in state.items()}
        missing, unexpected = model.load_state_dict(state, strict=False)
        logger.info("热启动 %s, missing %d unexpected %d", prev, len(missing), len(unexpected))
    model = DDP(model, device_ids=[local_rank], find_unused_parameters=True)

    optimizer = torch.optim.Adam(model.parameters(), lr=cfg["lr"])
    criterion = nn.BCEWithLogitsLoss()
    scene_weight = cfg.get("scene_weight", [1.0] * len(SCENES))

    step = 0
    for epoch in range(cfg["epochs"]):
        batch_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for sparse, dense, scene, label in loader:
            s = int(scene[0])  # 同一 batch 场景相同
            sparse, dense, label = sparse.to(device, non_blocking=True), dense.to(device, non_blocking=True), \
                label.to(device, non_blocking=True)
            loss = criterion(model(sparse, dense, s), label) * scene_weight[s]
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1
            if rank == 0 and step % cfg["log_every"] == 0:
                writer.add_scalar("train/loss_%s" % SCENES[s], loss.item(), step)
                logger.info("epoch %d step %d/%d scene %s loss %.5f %.1fs", epoch, step,
                            len(loader) * cfg["epochs"], SCENES[s], loss.item(), time.time() - t0)
                t0 = time.time()

        aucs = evaluate(model, val_set, device, cfg["batch_size"] * 4)
        if rank == 0:
            logger.info("epoch %d 各场景 AUC: %s", epoch, aucs)
            for name, v in aucs.items():
                writer.add_scalar("val/auc_%s" % name, v, epoch)
            torch.save(model.module.state_dict(), os.path.join(model_dir, "model_epoch%d.pt" % epoch))
        dist.barrier()

    if rank == 0:
        torch.save(model.module.state_dict(), os.path.join(model_dir, "model_final.pt"))
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
