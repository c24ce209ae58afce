"""EquiFM-style equivariant flow matching on QM9 (PyG), trainer class + OmegaConf config.

    torchrun --nproc_per_node=4 18_equifm_trainer.py configs/equifm_qm9.yaml trainer.max_epochs=2000
"""
import os
import sys
import time
import logging
from datetime import timedelta

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.distributed as dist
from omegaconf import OmegaConf
from torch.nn.parallel import DistributedDataParallel as DDP
from torch_geometric.datasets import QM9
from torch_geometric.loader import DataLoader
from torch_geometric.utils import scatter

logger = logging.getLogger("equifm")

DEFAULTS = OmegaConf.create({
    "data": {"root": "/shared/datasets/qm9_pyg", "n_val": 10000, "split_seed": 0},
    "model": {"hidden": 256, "layers": 9, "n_types": 5},
    "optim": {"lr": 2e-4, "weight_decay": 1e-12, "clip": 1.0},
    "trainer": {"max_epochs": 1000, "batch_size": 128, "num_workers": 4, "ema": 0.999,
                "val_every": 10, "ckpt_dir": "/shared/ckpt/equifm_qm9"},
})
Z_IDX = torch.full((10,), -1, dtype=torch.long)
Z_IDX[torch.tensor([1, 6, 7, 8, 9])] = torch.arange(5)


class EGCL(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.phi_e = nn.Sequential(nn.Linear(2 * d + 1, d), nn.SiLU(), nn.Linear(d, d), nn.SiLU())
        self.phi_h = nn.Sequential(nn.Linear(2 * d, d), nn.SiLU(), nn.Linear(d, d))
        self.phi_x = nn.Sequential(nn.Linear(d, d), nn.SiLU(), nn.Linear(d, 1, bias=False))

    def forward(self, h, x, ei):
        i, j = ei
        r = x[i] - x[j]
        d2 = r.pow(2).sum(-1, keepdim=True)
        m = self.phi_e(torch.cat([h[i], h[j], d2], -1))
        h = h + self.phi_h(torch.cat([h, scatter(m, i, 0, dim_size=h.size(0)) / 100.0], -1))
        x = x + scatter(r / (d2.sqrt() + 1) * self.phi_x(m), i, 0, dim_size=x.size(0)) / 100.0
        return h, x


class VelocityNet(nn.Module):
    def __init__(self, hidden, layers, n_types):
        super().__init__()
        self.inp = nn.Linear(n_types + 1, hidden)
        self.layers = nn.ModuleList(EGCL(hidden) for _ in range(layers))
        self.out = nn.Linear(hidden, n_types)

    def forward(self, x, h, t, batch):
        same = batch[:, None] == batch[None, :]
        ei = same.fill_diagonal_(False).nonzero().t()
        z = self.inp(torch.cat([h, t[batch, None]], -1))
        y = x
        for layer in self.layers:
            z, y = layer(z, y, ei)
        v = y - x
        return v - scatter(v, batch, 0, reduce="mean")[batch], self.out(z)


def zero_com(x, b):
    return x - scatter(x, b, 0, reduce="mean")[b]


class Trainer:
    def __init__(self, cfg):
        self.cfg = cfg
        self.local_rank = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(self.local_rank)
        dist.init_process_group("nccl", timeout=timedelta(minutes=60))
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.device = torch.device("cuda", self.local_rank)
        logging.basicConfig(level=logging.INFO if self.rank == 0 else logging.WARNING,
                            format="%(asctime)s [%(levelname)s] %(message)s")
        self._build_data()
        self._build_model()

    def _build_data(self):
        c = self.cfg.data
        if self.rank == 0:
            QM9(c.root)  # triggers processing once
        dist.barrier()
        ds = QM9(c.root)
        perm = torch.randperm(len(ds), generator=torch.Generator().manual_seed(c.split_seed))
        self.train_ds = ds[perm[c.n_val:]]
        self.val_ds = ds[perm[: c.n_val]]
        tc = self.cfg.trainer
        self.train_loader = DataLoader(self.train_ds, batch_size=tc.batch_size, shuffle=True,
                                       num_workers=tc.num_workers, pin_memory=True, drop_last=True)
        self.val_loader = DataLoader(self.val_ds, batch_size=tc.batch_size, num_workers=tc.num_workers)

    def _build_model(self):
        m = self.cfg.model
        self.net = VelocityNet(m.hidden, m.layers, m.n_types).to(self.device)
        self.ema = VelocityNet(m.hidden, m.layers, m.n_types).to(self.device).requires_grad_(False)
        self.model = DDP(self.net, device_ids=[self.local_rank])
        self.ema.load_state_dict(self.net.state_dict())
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=self.cfg.optim.lr,
                                     weight_decay=self.cfg.optim.weight_decay)
        self.epoch = 0
        path = os.path.join(self.cfg.trainer.ckpt_dir, "last.pt")
        if os.path.exists(path):
            st = torch.load(path, map_location=self.device)
            self.net.load_state_dict(st["net"])
            self.ema.load_state_dict(st["ema"])
            self.opt.load_state_dict(st["opt"])
            self.epoch = st["epoch"] + 1
            logger.info("resumed at epoch %d", self.epoch)

    def loss(self, model, data):
        b = data.batch
        t = torch.rand(data.num_graphs, device=b.device)
        tn = t[b, None]
        x1 = zero_com(data.pos, b)
        h1 = F.one_hot(Z_IDX.to(b.device)[data.z], self.cfg.model.n_types).float()
        x0, h0 = zero_com(torch.randn_like(x1), b), torch.randn_like(h1)
        v_x, v_h = model((1 - tn) * x0 + tn * x1, (1 - tn) * h0 + tn * h1, t, b)
        return F.mse_loss(v_x, x1 - x0) + F.mse_loss(v_h, h1 - h0)

    @torch.no_grad()
    def validate(self):
        self.ema.eval()
        tot, n = 0.0, 0
        for data in self.val_loader:
            data = data.to(self.device)
            tot += self.loss(self.ema, data).item() * data.num_graphs
            n += data.num_graphs
        return tot / n

    def save(self):
        os.makedirs(self.cfg.trainer.ckpt_dir, exist_ok=True)
        path = os.path.join(self.cfg.trainer.ckpt_dir, "last.pt")
        torch.save({"net": self.net.state_dict(), "ema": self.ema.state_dict(), "opt": self.opt.state_dict(),
                    "epoch": self.epoch, "cfg": OmegaConf.to_container(self.cfg)}, path + ".tmp")
        os.replace(path + ".tmp", path)

    def fit(self):
        tc = self.cfg.trainer
        while self.epoch < tc.max_epochs:
            self.model.train()
            tic, acc = time.time(), torch.zeros(2, device=self.device)
            for data in self.train_loader:
                data = data.to(self.device, non_blocking=True)
                loss = self.loss(self.model, data)
                self.opt.zero_grad(set_to_none=True)
                loss.backward()
                nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.optim.clip)
                self.opt.step()
                with torch.no_grad():
                    for pe, p in zip(self.ema.parameters(), self.net.parameters()):
                        pe.lerp_(p, 1 - tc.ema)
                acc += torch.stack([loss.detach(), torch.ones((), device=self.device)])
            dist.all_reduce(acc)
            logger.info("epoch %d train %.4f (%.0fs)", self.epoch, (acc[0] / acc[1]).item(), time.time() - tic)

            if self.rank == 0:
                if self.epoch % tc.val_every == 0:
                    logger.info("epoch %d val(ema) %.4f", self.epoch, self.validate())
                self.save()
            dist.barrier()
            self.epoch += 1
        dist.destroy_process_group()


if __name__ == "__main__":
    cfg = DEFAULTS
    if len(sys.argv) > 1 and sys.argv[1].endswith(".yaml"):
        cfg = OmegaConf.merge(cfg, OmegaConf.load(sys.argv[1]))
        sys.argv.pop(1)
    cfg = OmegaConf.merge(cfg, OmegaConf.from_cli(sys.argv[1:]))
    Trainer(cfg).fit()
