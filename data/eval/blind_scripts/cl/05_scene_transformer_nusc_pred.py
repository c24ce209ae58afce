"""Agent-centric transformer for the nuScenes prediction challenge (2 s history, 6 s future @ 2 Hz).

Launch:
    torchrun --standalone --nproc_per_node=4 05_scene_transformer_nusc_pred.py --exp-name st_k10
"""
import argparse
import logging
import os
import pickle
from dataclasses import dataclass, asdict

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

log = logging.getLogger(__name__)


@dataclass
class Config:
    data_dir: str = "/data/nuscenes_pred/cache"
    out_root: str = "/data/experiments/nusc_pred"
    exp_name: str = "debug"
    hist_len: int = 5
    fut_len: int = 12
    num_modes: int = 10
    d_model: int = 128
    n_layers: int = 4
    max_agents: int = 32
    max_lanes: int = 64
    lane_pts: int = 20
    batch_size: int = 32        # per GPU
    epochs: int = 60
    lr: float = 3e-4            # tuned for 4 GPUs x 32
    warmup_iters: int = 1000
    num_workers: int = 8


class PredictionDataset(Dataset):
    """One item = one target instance; token in `sample_token_instance_token` format."""

    def __init__(self, cfg, split):
        with open(os.path.join(cfg.data_dir, f"{split}.pkl"), "rb") as f:
            self.items = pickle.load(f)
        self.cfg = cfg

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        it = self.items[i]
        agents = torch.as_tensor(it["agents_hist"][: self.cfg.max_agents], dtype=torch.float32)  # (A, 5, 5)
        lanes = torch.as_tensor(it["lanes"][: self.cfg.max_lanes], dtype=torch.float32)          # (L, 20, 4)
        fut = torch.as_tensor(it["target_future"], dtype=torch.float32)                          # (12, 2)
        return agents, lanes, fut


def pad_collate(batch):
    A = max(b[0].shape[0] for b in batch)
    L = max(max(b[1].shape[0] for b in batch), 1)
    B = len(batch)
    agents = torch.zeros(B, A, *batch[0][0].shape[1:])
    lanes = torch.zeros(B, L, *batch[0][1].shape[1:])
    a_mask = torch.zeros(B, A, dtype=torch.bool)
    l_mask = torch.zeros(B, L, dtype=torch.bool)
    for i, (ag, ln, _) in enumerate(batch):
        agents[i, : ag.shape[0]] = ag
        a_mask[i, : ag.shape[0]] = True
        if ln.shape[0] > 0:
            lanes[i, : ln.shape[0]] = ln
            l_mask[i, : ln.shape[0]] = True
    fut = torch.stack([b[2] for b in batch])
    return agents, a_mask, lanes, l_mask, fut


class TrajPredictor(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        d = cfg.d_model
        self.cfg = cfg
        self.agent_gru = nn.GRU(5, d, batch_first=True)
        self.lane_mlp = nn.Sequential(nn.Linear(4, d), nn.LayerNorm(d), nn.ReLU(), nn.Linear(d, d))
        self.type_emb = nn.Embedding(2, d)
        enc = nn.TransformerEncoderLayer(d, 8, 4 * d, dropout=0.1, batch_first=True)
        self.encoder = nn.TransformerEncoder(enc, cfg.n_layers)
        self.mode_queries = nn.Parameter(torch.randn(cfg.num_modes, d) * 0.02)
        dec = nn.TransformerDecoderLayer(d, 8, 4 * d, dropout=0.1, batch_first=True)
        self.decoder = nn.TransformerDecoder(dec, 2)
        self.traj_out = nn.Linear(d, cfg.fut_len * 2)
        self.prob_out = nn.Linear(d, 1)

    def forward(self, agents, a_mask, lanes, l_mask):
        B, A, T, Fd = agents.shape
        _, h = self.agent_gru(agents.view(B * A, T, Fd))
        a_tok = h[-1].view(B, A, -1) + self.type_emb.weight[0]
        l_tok = self.lane_mlp(lanes).max(dim=2).values + self.type_emb.weight[1]
        tokens = torch.cat([a_tok, l_tok], 1)
        pad = ~torch.cat([a_mask, l_mask], 1)
        mem = self.encoder(tokens, src_key_padding_mask=pad)
        q = self.mode_queries.unsqueeze(0).expand(B, -1, -1) + mem[:, :1]  # target agent is index 0
        out = self.decoder(q, mem, memory_key_padding_mask=pad)
        trajs = self.traj_out(out).view(B, self.cfg.num_modes, self.cfg.fut_len, 2).cumsum(2)
        return trajs, self.prob_out(out).squeeze(-1)


class Trainer:
    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.local_rank = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(self.local_rank)
        dist.init_process_group("nccl")
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.is_main = self.rank == 0
        self.device = torch.device("cuda", self.local_rank)
        self.out_dir = os.path.join(cfg.out_root, cfg.exp_name)
        logging.basicConfig(level=logging.INFO if self.is_main else logging.ERROR,
                            format="[%(asctime)s] %(message)s")

        self.train_set = PredictionDataset(cfg, "train")
        self.val_set = PredictionDataset(cfg, "val")
        self.train_sampler = DistributedSampler(self.train_set, shuffle=True, drop_last=True)
        self.val_sampler = DistributedSampler(self.val_set, shuffle=False)
        self.train_loader = DataLoader(self.train_set, cfg.batch_size, sampler=self.train_sampler,
                                       num_workers=cfg.num_workers, collate_fn=pad_collate,
                                       pin_memory=True, drop_last=True, persistent_workers=True)
        self.val_loader = DataLoader(self.val_set, cfg.batch_size, sampler=self.val_sampler,
                                     num_workers=cfg.num_workers, collate_fn=pad_collate, pin_memory=True)

        self.net = TrajPredictor(cfg).to(self.device)
        self.model = DDP(self.net, device_ids=[self.local_rank])
        lr = cfg.lr * (self.world * cfg.batch_size) / (4 * 32)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=0.01)
        total = cfg.epochs * len(self.train_loader)
        self.sched = torch.optim.lr_scheduler.OneCycleLR(self.opt, max_lr=lr, total_steps=total,
                                                         pct_start=cfg.warmup_iters / total)
        self.writer = SummaryWriter(self.out_dir) if self.is_main else None
        self.best_fde = float("inf")
        self.step = 0

    def loss_fn(self, trajs, logits, fut):
        err = torch.norm(trajs - fut[:, None], dim=-1)
        best = err.mean(-1).argmin(-1)
        idx = torch.arange(trajs.shape[0], device=trajs.device)
        reg = F.smooth_l1_loss(trajs[idx, best], fut)
        cls = F.cross_entropy(logits, best)
        return reg + 0.5 * cls

    def train_epoch(self, epoch):
        self.model.train()
        self.train_sampler.set_epoch(epoch)
        for agents, a_mask, lanes, l_mask, fut in self.train_loader:
            agents, a_mask = agents.to(self.device, non_blocking=True), a_mask.to(self.device)
            lanes, l_mask = lanes.to(self.device, non_blocking=True), l_mask.to(self.device)
            fut = fut.to(self.device)
            trajs, logits = self.model(agents, a_mask, lanes, l_mask)
            loss = self.loss_fn(trajs, logits, fut)
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(self.model.parameters(), 3.0)
            self.opt.step()
            self.sched.step()
            self.step += 1
            if self.step % 100 == 0:
                loss_t = loss.detach()
                dist.all_reduce(loss_t)
                if self.is_main:
                    self.writer.add_scalar("train/loss", loss_t.item() / self.world, self.step)
                    self.writer.add_scalar("train/lr", self.sched.get_last_lr()[0], self.step)

    @torch.no_grad()
    def evaluate(self):
        self.net.eval()
        ade5 = ade10 = fde10 = miss = n = 0.0
        for agents, a_mask, lanes, l_mask, fut in self.val_loader:
            trajs, logits = self.net(agents.to(self.device), a_mask.to(self.device),
                                     lanes.to(self.device), l_mask.to(self.device))
            fut = fut.to(self.device)
            order = logits.argsort(dim=-1, descending=True)
            trajs = torch.gather(trajs, 1, order[..., None, None].expand_as(trajs))
            err = torch.norm(trajs - fut[:, None], dim=-1)  # (B, K, T)
            ade5 += err[:, :5].mean(-1).min(-1).values.sum().item()
            ade10 += err.mean(-1).min(-1).values.sum().item()
            fde10 += err[..., -1].min(-1).values.sum().item()
            miss += (err.max(-1).values.min(-1).values > 2.0).float().sum().item()
            n += fut.shape[0]
        self.net.train()
        return {"minADE_5": ade5 / n, "minADE_10": ade10 / n, "minFDE_10": fde10 / n, "MissRate_2_10": miss / n}

    def save(self, name, epoch):
        torch.save({"model": self.net.state_dict(), "opt": self.opt.state_dict(),
                    "sched": self.sched.state_dict(), "epoch": epoch, "cfg": asdict(self.cfg)},
                   os.path.join(self.out_dir, name))

    def fit(self):
        if self.is_main:
            os.makedirs(self.out_dir, exist_ok=True)
            log.info("config: %s", asdict(self.cfg))
        for epoch in range(self.cfg.epochs):
            self.train_epoch(epoch)
            metrics = self.evaluate()
            if self.is_main:
                log.info("epoch %d %s", epoch, " ".join(f"{k}={v:.3f}" for k, v in metrics.items()))
                for k, v in metrics.items():
                    self.writer.add_scalar(f"val/{k}", v, epoch)
                self.save("last.pt", epoch)
                if metrics["minFDE_10"] < self.best_fde:
                    self.best_fde = metrics["minFDE_10"]
                    self.save("best.pt", epoch)
            dist.barrier()
        if self.is_main:
            self.writer.close()
        dist.destroy_process_group()


def parse_cli():
    cfg = Config()
    ap = argparse.ArgumentParser()
    for k, v in asdict(cfg).items():
        ap.add_argument(f"--{k.replace('_', '-')}", type=type(v), default=v)
    return Config(**vars(ap.parse_args()))


if __name__ == "__main__":
    Trainer(parse_cli()).fit()
