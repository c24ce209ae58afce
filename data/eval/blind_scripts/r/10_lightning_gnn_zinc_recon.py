"""GatedGCN-style regressor for ZINC (constrained solubility), PyG + Lightning 2.x.

    python 10_lightning_gnn_zinc_recon.py --gpus 4
Optional node-feature reconstruction auxiliary loss (--recon-weight), off by default.
"""
import argparse
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint, RichProgressBar
from lightning.pytorch.loggers import CSVLogger
from torch_geometric.datasets import ZINC
from torch_geometric.loader import DataLoader
from torch_geometric.nn import global_add_pool
from torch_geometric.utils import scatter

NUM_ATOM_TYPES = 28
NUM_BOND_TYPES = 4


class GatedGCNLayer(nn.Module):
    def __init__(self, dim, dropout=0.0):
        super().__init__()
        self.A, self.B, self.C = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.D, self.E = nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.norm_h, self.norm_e = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.dropout = dropout

    def forward(self, h, e, edge_index):
        src, dst = edge_index
        Ah, Bh, Dh, Eh, Ce = self.A(h), self.B(h), self.D(h), self.E(h), self.C(e)
        e_new = Dh[dst] + Eh[src] + Ce
        sigma = torch.sigmoid(e_new)
        num = scatter(sigma * Bh[src], dst, dim=0, dim_size=h.size(0), reduce="sum")
        den = scatter(sigma, dst, dim=0, dim_size=h.size(0), reduce="sum") + 1e-6
        h_new = Ah + num / den
        h_new = F.dropout(F.relu(self.norm_h(h_new)), self.dropout, self.training)
        e_new = F.dropout(F.relu(self.norm_e(e_new)), self.dropout, self.training)
        return h + h_new, e + e_new


class ZincNet(nn.Module):
    def __init__(self, dim=96, layers=8, dropout=0.0):
        super().__init__()
        self.atom_emb = nn.Embedding(NUM_ATOM_TYPES, dim)
        self.bond_emb = nn.Embedding(NUM_BOND_TYPES, dim)
        self.layers = nn.ModuleList([GatedGCNLayer(dim, dropout) for _ in range(layers)])
        self.readout = nn.Sequential(nn.Linear(dim, dim), nn.ReLU(), nn.Linear(dim, dim // 2), nn.ReLU(),
                                     nn.Linear(dim // 2, 1))
        self.node_decoder = nn.Linear(dim, NUM_ATOM_TYPES)

    def forward(self, data):
        h = self.atom_emb(data.x.squeeze(-1))
        e = self.bond_emb(data.edge_attr)
        for layer in self.layers:
            h, e = layer(h, e, data.edge_index)
        return self.readout(global_add_pool(h, data.batch)).squeeze(-1), h


class ZincModule(pl.LightningModule):
    def __init__(self, dim=96, layers=8, lr=1e-3, recon_weight=0.0, mask_rate=0.15):
        super().__init__()
        self.save_hyperparameters()
        self.net = ZincNet(dim, layers)

    def training_step(self, data, batch_idx):
        target = data.y
        if self.hparams.recon_weight > 0:
            mask = torch.rand(data.num_nodes, device=self.device) < self.hparams.mask_rate
            atoms = data.x.squeeze(-1).clone()
            data.x = data.x.masked_fill(mask.unsqueeze(-1), 0)
        pred, h = self.net(data)
        loss = F.l1_loss(pred, target)
        if self.hparams.recon_weight > 0:
            recon = F.cross_entropy(self.net.node_decoder(h[mask]), atoms[mask])
            self.log("train/recon", recon, sync_dist=True)
            loss = loss + self.hparams.recon_weight * recon
        self.log("train/mae", F.l1_loss(pred.detach(), target), prog_bar=True, sync_dist=True,
                 batch_size=data.num_graphs)
        return loss

    def _eval(self, data, stage):
        pred, _ = self.net(data)
        self.log(f"{stage}/mae", F.l1_loss(pred, data.y), prog_bar=True, sync_dist=True,
                 batch_size=data.num_graphs)

    def validation_step(self, data, batch_idx):
        self._eval(data, "val")

    def test_step(self, data, batch_idx):
        self._eval(data, "test")

    def configure_optimizers(self):
        opt = torch.optim.Adam(self.parameters(), lr=self.hparams.lr)
        sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, mode="min", factor=0.5, patience=15, min_lr=1e-5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "monitor": "val/mae"}}


class ZincData(pl.LightningDataModule):
    def __init__(self, root, batch_size=128, workers=4):
        super().__init__()
        self.root, self.batch_size, self.workers = root, batch_size, workers

    def prepare_data(self):
        for split in ("train", "val", "test"):
            ZINC(self.root, subset=True, split=split)

    def setup(self, stage=None):
        self.train_set = ZINC(self.root, subset=True, split="train")
        self.val_set = ZINC(self.root, subset=True, split="val")
        self.test_set = ZINC(self.root, subset=True, split="test")

    def train_dataloader(self):
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True, num_workers=self.workers)

    def val_dataloader(self):
        return DataLoader(self.val_set, batch_size=self.batch_size, num_workers=self.workers)

    def test_dataloader(self):
        return DataLoader(self.test_set, batch_size=self.batch_size, num_workers=self.workers)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="data/ZINC")
    ap.add_argument("--gpus", type=int, default=4)
    ap.add_argument("--epochs", type=int, default=400)
    ap.add_argument("--bs", type=int, default=128)
    ap.add_argument("--dim", type=int, default=96)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--recon-weight", type=float, default=0.0)
    ap.add_argument("--out", default="runs/zinc_gatedgcn")
    args = ap.parse_args()

    pl.seed_everything(41)
    dm = ZincData(args.root, args.bs)
    model = ZincModule(args.dim, args.layers, args.lr, recon_weight=args.recon_weight)
    ckpt = ModelCheckpoint(dirpath=os.path.join(args.out, "ckpt"), monitor="val/mae", mode="min", save_last=True)
    trainer = pl.Trainer(accelerator="gpu", devices=args.gpus, strategy="ddp", max_epochs=args.epochs,
                         logger=CSVLogger(args.out), callbacks=[ckpt, RichProgressBar()],
                         gradient_clip_val=1.0)
    trainer.fit(model, datamodule=dm)
    trainer.test(model, datamodule=dm, ckpt_path="best")


if __name__ == "__main__":
    main()
