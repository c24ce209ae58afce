#!/usr/bin/env python
"""Train LightGCN on the view->purchase graph and export user / item embeddings
for the ANN index (faiss) used by the homepage candidate generator.

    torchrun --nproc_per_node=4 lightgcn_export.py --graph /mnt/graphs/vp/2024w22.pt \
        --run-dir /mnt/experiments/lightgcn_vp/2024w22
"""
import argparse
import os
import time

import mlflow
import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torch_geometric.nn import LightGCN


class Trainer:
    def __init__(self, args):
        self.args = args
        self.local_rank = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(self.local_rank)
        dist.init_process_group("nccl")
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.device = torch.device("cuda", self.local_rank)
        self.is_main = self.rank == 0

        g = torch.load(args.graph)
        self.nu, self.ni = g["num_users"], g["num_items"]
        self.train_ei = g["train_edge_index"].to(self.device)     # (user, item) pairs
        self.val_ei = g["val_edge_index"].to(self.device)
        u, i = self.train_ei
        self.msg_ei = torch.stack([torch.cat([u, i + self.nu]), torch.cat([i + self.nu, u])])

        torch.manual_seed(args.seed)
        self.model = DDP(LightGCN(self.nu + self.ni, args.dim, args.layers).to(self.device),
                         device_ids=[self.local_rank])
        # per-GPU batch is fixed, so scale lr with the number of GPUs (linear rule, with warmup)
        self.opt = torch.optim.Adam(self.model.parameters(), lr=args.base_lr * self.world)
        self.sched = torch.optim.lr_scheduler.LambdaLR(
            self.opt, lambda step: min(1.0, (step + 1) / args.warmup_steps))

        idx = range(self.train_ei.size(1))
        self.sampler = DistributedSampler(idx, shuffle=True, seed=args.seed)
        self.loader = DataLoader(idx, batch_size=args.batch_size, sampler=self.sampler)
        self.ckpt_path = os.path.join(args.run_dir, "best.pt")

    def train_epoch(self, epoch):
        self.sampler.set_epoch(epoch)
        self.model.train()
        tot, n = torch.zeros((), device=self.device), 0
        for idx in self.loader:
            idx = idx.to(self.device)
            u, i = self.train_ei[:, idx]
            neg = torch.randint(0, self.ni, (idx.numel(),), device=self.device)
            eli = torch.stack([torch.cat([u, u]), torch.cat([i, neg]) + self.nu])
            pos_rank, neg_rank = self.model(self.msg_ei, eli).chunk(2)
            loss = self.model.module.recommendation_loss(
                pos_rank, neg_rank, node_id=eli.unique(), lambda_reg=self.args.reg)
            self.opt.zero_grad()
            loss.backward()
            self.opt.step()
            self.sched.step()
            tot += loss.detach()
            n += 1
        stats = torch.stack([tot, torch.tensor(float(n), device=self.device)])
        dist.all_reduce(stats)
        return (stats[0] / stats[1]).item()

    @torch.no_grad()
    def recall_at_k(self, k):
        self.model.eval()
        emb = self.model.module.get_embedding(self.msg_ei)
        ue, ie = emb[: self.nu], emb[self.nu:]
        users = torch.unique(self.val_ei[0])[self.rank::self.world]
        hit_sum = torch.zeros((), device=self.device)
        for chunk in users.split(4096):
            row = torch.full((self.nu,), -1, dtype=torch.long, device=self.device)
            row[chunk] = torch.arange(chunk.numel(), device=self.device)
            s = ue[chunk] @ ie.t()
            r = row[self.train_ei[0]]
            s[r[r >= 0], self.train_ei[1][r >= 0]] = -float("inf")
            top = s.topk(k, dim=1).indices
            truth = torch.zeros_like(s, dtype=torch.bool)
            r = row[self.val_ei[0]]
            truth[r[r >= 0], self.val_ei[1][r >= 0]] = True
            hit_sum += (truth.gather(1, top).sum(1) / truth.sum(1).clamp(max=k)).sum()
        out = torch.stack([hit_sum, torch.tensor(float(users.numel()), device=self.device)])
        dist.all_reduce(out)
        return (out[0] / out[1]).item()

    def fit(self):
        best = -1.0
        for epoch in range(self.args.epochs):
            t0 = time.time()
            loss = self.train_epoch(epoch)
            recall = self.recall_at_k(self.args.k)
            if self.is_main:
                mlflow.log_metrics({"bpr_loss": loss, f"recall_at_{self.args.k}": recall}, step=epoch)
                print(f"epoch {epoch} loss {loss:.4f} recall@{self.args.k} {recall:.4f} "
                      f"lr {self.sched.get_last_lr()[0]:.2e} ({time.time() - t0:.0f}s)", flush=True)
                if recall > best:
                    best = recall
                    torch.save(self.model.state_dict(), self.ckpt_path)
        dist.barrier()
        return best

    def export(self):
        """Rebuild a plain LightGCN from the best checkpoint and dump embeddings."""
        if not self.is_main:
            return
        model = LightGCN(self.nu + self.ni, self.args.dim, self.args.layers)
        model.load_state_dict(torch.load(self.ckpt_path, map_location="cpu"))
        model = model.to(self.device).eval()
        with torch.no_grad():
            emb = model.get_embedding(self.msg_ei).cpu().numpy().astype(np.float32)
        np.save(os.path.join(self.args.run_dir, "user_emb.npy"), emb[: self.nu])
        np.save(os.path.join(self.args.run_dir, "item_emb.npy"), emb[self.nu:])
        mlflow.log_artifacts(self.args.run_dir, artifact_path="embeddings")
        print(f"exported {self.nu} user / {self.ni} item embeddings to {self.args.run_dir}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--graph", required=True)
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--batch-size", type=int, default=4096, help="per GPU")
    ap.add_argument("--base-lr", type=float, default=5e-4)
    ap.add_argument("--warmup-steps", type=int, default=500)
    ap.add_argument("--reg", type=float, default=1e-4)
    ap.add_argument("--k", type=int, default=20)
    ap.add_argument("--seed", type=int, default=17)
    args = ap.parse_args()

    trainer = Trainer(args)
    if trainer.is_main:
        os.makedirs(args.run_dir, exist_ok=True)
        mlflow.set_experiment("lightgcn_view_purchase")
        mlflow.start_run(run_name=os.path.basename(args.run_dir.rstrip("/")))
        mlflow.log_params(vars(args))
    best = trainer.fit()
    trainer.export()
    if trainer.is_main:
        mlflow.log_metric("best_recall", best)
        mlflow.end_run()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
