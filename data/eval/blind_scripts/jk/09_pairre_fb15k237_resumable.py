"""PairRE (Chao et al. 2021) with self-adversarial negatives; step-based, resumable.

Meant for preemptible multi-node jobs: a checkpoint is written every --save_every steps
to the shared run directory and the job resumes from it automatically.

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$HEAD:29500 \
        09_pairre_fb15k237_resumable.py --run_dir /shared/runs/pairre_fb237
"""
import argparse
import logging
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

log = logging.getLogger("pairre")


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data_dir", default="data/FB15k-237")
    ap.add_argument("--run_dir", required=True)
    ap.add_argument("--dim", type=int, default=1500)
    ap.add_argument("--gamma", type=float, default=6.0)
    ap.add_argument("--adv_temp", type=float, default=1.0)
    ap.add_argument("--neg", type=int, default=256)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=5e-5)
    ap.add_argument("--max_steps", type=int, default=100000)
    ap.add_argument("--save_every", type=int, default=2000)
    ap.add_argument("--eval_every", type=int, default=20000)
    ap.add_argument("--test_batch", type=int, default=32)
    return ap.parse_args()


def load_ids(path):
    with open(path) as f:
        return {k: int(v) for v, k in (l.strip().split("\t") for l in f)}


def load_triples(path, e2id, r2id):
    with open(path) as f:
        return torch.tensor([(e2id[h], r2id[r], e2id[t]) for h, r, t in (l.strip().split("\t") for l in f)])


class TrainSet(Dataset):
    def __init__(self, triples, n_ent, neg):
        self.triples, self.n_ent, self.neg = triples, n_ent, neg

    def __len__(self):
        return len(self.triples)

    def __getitem__(self, i):
        return self.triples[i], torch.randint(self.n_ent, (self.neg,))


class PairRE(nn.Module):
    def __init__(self, n_ent, n_rel, dim, gamma):
        super().__init__()
        self.gamma = gamma
        bound = (gamma + 2.0) / dim
        self.entity = nn.Parameter(torch.empty(n_ent, dim).uniform_(-bound, bound))
        self.relation = nn.Parameter(torch.empty(n_rel, 2 * dim).uniform_(-bound, bound))

    def score(self, h, r, t):
        h, t = F.normalize(h, dim=-1), F.normalize(t, dim=-1)
        r_h, r_t = r.chunk(2, dim=-1)
        return self.gamma - torch.norm(h * r_h - t * r_t, p=1, dim=-1)

    def forward(self, pos, neg, corrupt_head):
        h = self.entity[pos[:, 0]].unsqueeze(1)
        r = self.relation[pos[:, 1]].unsqueeze(1)
        t = self.entity[pos[:, 2]].unsqueeze(1)
        ne = self.entity[neg]
        pos_s = self.score(h, r, t).squeeze(1)
        neg_s = self.score(ne, r, t) if corrupt_head else self.score(h, r, ne)
        return pos_s, neg_s


def save_checkpoint(path, model, opt, step, epoch):
    tmp = path + ".tmp"
    torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "step": step, "epoch": epoch}, tmp)
    os.replace(tmp, path)


@torch.no_grad()
def evaluate(model, triples, hr2t, rt2h, bs, device, rank, world):
    model.eval()
    ent = model.entity
    part = triples[rank::world]
    s = torch.zeros(4, dtype=torch.float64, device=device)
    for i in range(0, len(part), bs):
        b = part[i:i + bs].to(device)
        h, r, t = ent[b[:, 0]][:, None], model.relation[b[:, 1]][:, None], ent[b[:, 2]][:, None]
        for scores, gold, known in ((model.score(h, r, ent[None]), b[:, 2], [hr2t[k] for k in b[:, :2].tolist()]),
                                    (model.score(ent[None], r, t), b[:, 0], [rt2h[k] for k in b[:, 1:].tolist()])):
            g = scores.gather(1, gold[:, None])
            for j, ks in enumerate(known):
                scores[j, ks] = float("-inf")
            rk = 1 + (scores > g).sum(1).double()
            s += torch.stack([(1 / rk).sum(), (rk <= 1).sum(), (rk <= 10).sum(),
                              torch.tensor(len(rk), device=device, dtype=torch.float64)])
    dist.all_reduce(s)
    return {"mrr": (s[0] / s[3]).item(), "hits@1": (s[1] / s[3]).item(), "hits@10": (s[2] / s[3]).item()}


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(asctime)s %(message)s")

    e2id = load_ids(os.path.join(args.data_dir, "entities.dict"))
    r2id = load_ids(os.path.join(args.data_dir, "relations.dict"))
    tr, va, te = (load_triples(os.path.join(args.data_dir, f"{s}.txt"), e2id, r2id) for s in ("train", "valid", "test"))
    hr2t, rt2h = {}, {}
    for h, r, t in torch.cat([tr, va, te]).tolist():
        hr2t.setdefault((h, r), []).append(t)
        rt2h.setdefault((r, t), []).append(h)

    model = PairRE(len(e2id), len(r2id), args.dim, args.gamma).to(device)
    ddp = DDP(model, device_ids=[local_rank])
    opt = torch.optim.Adam(ddp.parameters(), lr=args.lr)

    ckpt_path = os.path.join(args.run_dir, "checkpoint.pt")
    step, epoch = 0, 0
    if os.path.exists(ckpt_path):
        ck = torch.load(ckpt_path, map_location=device)
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        step, epoch = ck["step"], ck["epoch"]
        log.info("resumed from step %d", step)
    os.makedirs(args.run_dir, exist_ok=True)

    ds = TrainSet(tr, len(e2id), args.neg)
    sampler = DistributedSampler(ds, shuffle=True, drop_last=True)
    loader = DataLoader(ds, batch_size=args.batch, sampler=sampler, num_workers=4, pin_memory=True, drop_last=True)

    loss_meter = torch.zeros(2, device=device)
    t0 = time.time()
    while step < args.max_steps:
        sampler.set_epoch(epoch)
        for pos, neg in loader:
            ddp.train()
            pos, neg = pos.to(device, non_blocking=True), neg.to(device, non_blocking=True)
            pos_s, neg_s = ddp(pos, neg, corrupt_head=bool(step % 2))
            w = F.softmax(neg_s * args.adv_temp, dim=1).detach()
            loss = -0.5 * (F.logsigmoid(pos_s).mean() + (w * F.logsigmoid(-neg_s)).sum(1).mean())
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1
            loss_meter += torch.stack([loss.detach(), torch.ones((), device=device)])

            if step % args.save_every == 0:
                dist.all_reduce(loss_meter)
                log.info("step %d loss %.4f (%.1f steps/s)", step, (loss_meter[0] / loss_meter[1]).item(),
                         args.save_every / (time.time() - t0))
                loss_meter.zero_()
                t0 = time.time()
                save_checkpoint(ckpt_path, ddp, opt, step, epoch)
            if step % args.eval_every == 0:
                log.info("valid @%d %s", step, evaluate(model, va, hr2t, rt2h, args.test_batch, device, rank, world))
            if step >= args.max_steps:
                break
        else:
            epoch += 1

    log.info("test %s", evaluate(model, te, hr2t, rt2h, args.test_batch, device, rank, world))
    if rank == 0:
        torch.save(model.state_dict(), os.path.join(args.run_dir, "final_model.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
