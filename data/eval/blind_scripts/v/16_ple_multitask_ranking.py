# PLE (progressive layered extraction) ranker for the video feed: CTR + CVR(follow) heads, plus an
# auxiliary watch-time regression head that is switched on after a warm-up period.
#
# Training data: MDS shards written by the Spark export job (one row = one impression).
#
# PyTorchJob "ple-feed-ranker" (3 pods x 8 A100-80G), container args:
#   torchrun --nnodes=3 --nproc_per_node=8 --rdzv_backend=c10d \
#       --rdzv_endpoint=${MASTER_ADDR}:${MASTER_PORT} --rdzv_id=${JOB_UID} \
#       ple_ranker.py --remote gs://rank-data/feed/mds/2025-01 --local /tmp/mds \
#       --val-remote gs://rank-data/feed/mds/2025-01-val --out gs://rank-models/ple/2025-01 \
#       --aux-start-step 20000
import argparse
import os
import time

import fsspec
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import wandb
from streaming import StreamingDataset
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torchmetrics.classification import BinaryAUROC

N_SPARSE = 40
N_DENSE = 64
VOCAB = 2_000_000


def cli():
    p = argparse.ArgumentParser()
    p.add_argument("--remote", required=True)
    p.add_argument("--local", default="/tmp/mds")
    p.add_argument("--val-remote", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--batch-size", type=int, default=2048)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--max-steps", type=int, default=120_000)
    p.add_argument("--aux-start-step", type=int, default=20_000)
    p.add_argument("--aux-weight", type=float, default=0.2)
    p.add_argument("--eval-every", type=int, default=10_000)
    return p.parse_args()


def expert(d_in, d_out):
    return nn.Sequential(nn.Linear(d_in, d_out), nn.ReLU(), nn.Linear(d_out, d_out), nn.ReLU())


class CGC(nn.Module):
    """One extraction layer: shared experts + per-task experts, per-task gates."""

    def __init__(self, d_in, d_out, n_tasks, n_shared=4, n_specific=2, last=False):
        super().__init__()
        self.n_tasks, self.last = n_tasks, last
        self.shared = nn.ModuleList([expert(d_in, d_out) for _ in range(n_shared)])
        self.specific = nn.ModuleList([nn.ModuleList([expert(d_in, d_out) for _ in range(n_specific)])
                                       for _ in range(n_tasks)])
        self.gates = nn.ModuleList([nn.Linear(d_in, n_shared + n_specific) for _ in range(n_tasks)])
        if not last:
            self.shared_gate = nn.Linear(d_in, n_shared + n_tasks * n_specific)

    def forward(self, task_inputs, shared_input):
        sh = [e(shared_input) for e in self.shared]
        outs, all_spec = [], []
        for t in range(self.n_tasks):
            sp = [e(task_inputs[t]) for e in self.specific[t]]
            all_spec += sp
            ex = torch.stack(sh + sp, 1)
            g = torch.softmax(self.gates[t](task_inputs[t]), -1).unsqueeze(-1)
            outs.append((g * ex).sum(1))
        if self.last:
            return outs, None
        g = torch.softmax(self.shared_gate(shared_input), -1).unsqueeze(-1)
        return outs, (g * torch.stack(sh + all_spec, 1)).sum(1)


class PLERanker(nn.Module):
    def __init__(self, emb_dim=16):
        super().__init__()
        self.emb = nn.EmbeddingBag(VOCAB, emb_dim, mode="sum")
        d_in = N_SPARSE * emb_dim + N_DENSE
        self.l1 = CGC(d_in, 256, n_tasks=2)
        self.l2 = CGC(256, 128, n_tasks=2, last=True)
        self.ctr_tower = nn.Sequential(nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 1))
        self.cvr_tower = nn.Sequential(nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 1))
        self.watch_tower = nn.Sequential(nn.Linear(256, 64), nn.ReLU(), nn.Linear(64, 1))

    def forward(self, sparse, dense, with_aux=False):
        b = sparse.size(0)
        offsets = torch.arange(0, b * N_SPARSE, device=sparse.device)
        e = self.emb(sparse.reshape(-1) % VOCAB, offsets).view(b, -1)
        x = torch.cat([e, dense], 1)
        h1, shared = self.l1([x, x], x)
        h2, _ = self.l2(h1, shared)
        out = {"ctr": self.ctr_tower(h2[0]).squeeze(-1), "cvr": self.cvr_tower(h2[1]).squeeze(-1)}
        if with_aux:
            out["watch"] = self.watch_tower(shared).squeeze(-1)
        return out


def to_tensors(batch, device):
    return (batch["sparse"].to(device, non_blocking=True).long(), batch["dense"].to(device, non_blocking=True).float(),
            batch["click"].to(device).float(), batch["follow"].to(device).float(),
            batch["watch_sec"].to(device).float())


@torch.no_grad()
def evaluate(net, loader, device):
    net.eval()
    auc_ctr, auc_ctcvr = BinaryAUROC().to(device), BinaryAUROC().to(device)
    for batch in loader:
        sparse, dense, click, follow, _ = to_tensors(batch, device)
        out = net(sparse, dense)
        p_ctr = torch.sigmoid(out["ctr"])
        auc_ctr.update(p_ctr, click.long())
        auc_ctcvr.update(p_ctr * torch.sigmoid(out["cvr"]), (click * follow).long())
    net.train()
    return auc_ctr.compute().item(), auc_ctcvr.compute().item()


def main():
    args = cli()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    train_ds = StreamingDataset(remote=args.remote, local=os.path.join(args.local, "train"),
                                shuffle=True, batch_size=args.batch_size, shuffle_seed=9)
    val_ds = StreamingDataset(remote=args.val_remote, local=os.path.join(args.local, "val"),
                              shuffle=False, batch_size=8192)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, num_workers=8, pin_memory=True, drop_last=True)
    val_dl = DataLoader(val_ds, batch_size=8192, num_workers=4, pin_memory=True)

    torch.manual_seed(0)
    model = DDP(PLERanker().to(device), device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)

    if rank == 0:
        wandb.init(project="feed-ranking", name=f"ple-{os.path.basename(args.remote)}", config=vars(args))

    step, epoch, t0 = 0, 0, time.time()
    while step < args.max_steps:
        for batch in train_dl:
            sparse, dense, click, follow, watch = to_tensors(batch, device)
            use_aux = step >= args.aux_start_step
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = model(sparse, dense, with_aux=use_aux)
            loss_ctr = F.binary_cross_entropy_with_logits(out["ctr"].float(), click)
            # ESMM-style: CVR is supervised on the click*follow product over the full impression space
            p_ctcvr = torch.sigmoid(out["ctr"].float()) * torch.sigmoid(out["cvr"].float())
            loss_ctcvr = F.binary_cross_entropy(p_ctcvr.clamp(1e-7, 1 - 1e-7), click * follow)
            loss = loss_ctr + loss_ctcvr
            if use_aux:
                loss = loss + args.aux_weight * F.huber_loss(out["watch"].float(), torch.log1p(watch))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1

            if step % 200 == 0:
                stats = torch.stack([loss_ctr.detach(), loss_ctcvr.detach()])
                dist.all_reduce(stats, op=dist.ReduceOp.AVG)
                if rank == 0:
                    wandb.log({"loss/ctr": stats[0].item(), "loss/ctcvr": stats[1].item(),
                               "qps": 200 * args.batch_size * world / (time.time() - t0)}, step=step)
                    t0 = time.time()
            if step % args.eval_every == 0:
                a_ctr, a_ctcvr = evaluate(model.module, val_dl, device)
                if rank == 0:
                    wandb.log({"eval/auc_ctr": a_ctr, "eval/auc_ctcvr": a_ctcvr}, step=step)
                    with fsspec.open(f"{args.out}/step_{step}.pt", "wb") as f:
                        torch.save({"model": model.module.state_dict(), "step": step}, f)
            if step >= args.max_steps:
                break
        epoch += 1

    if rank == 0:
        wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
