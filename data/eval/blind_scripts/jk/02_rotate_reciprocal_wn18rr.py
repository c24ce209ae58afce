"""RotatE with reciprocal (inverse) relations, self-adversarial negative sampling.

Head-batch and tail-batch updates alternate, as in the original RotatE code; the
inverse-relation table is only touched by head-batch steps.

    torchrun --standalone --nproc_per_node=8 02_rotate_reciprocal_wn18rr.py \
        --data_path data/wn18rr --save_path ckpt/rotate_wn18rr
"""
import argparse
import logging
import math
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data_path", required=True)
    ap.add_argument("--save_path", required=True)
    ap.add_argument("--hidden_dim", type=int, default=500)
    ap.add_argument("--gamma", type=float, default=6.0)
    ap.add_argument("--adv_temperature", type=float, default=0.5)
    ap.add_argument("--negative_sample_size", type=int, default=1024)
    ap.add_argument("--batch_size", type=int, default=64, help="per process")
    ap.add_argument("--test_batch_size", type=int, default=16)
    ap.add_argument("--learning_rate", type=float, default=5e-5)
    ap.add_argument("--max_steps", type=int, default=80000)
    ap.add_argument("--valid_steps", type=int, default=10000)
    ap.add_argument("--log_steps", type=int, default=500)
    ap.add_argument("--resume", default=None)
    return ap.parse_args()


def read_dict(path):
    with open(path) as f:
        return {name: int(idx) for idx, name in (l.strip().split("\t") for l in f)}


def read_triples(path, e2id, r2id):
    out = []
    with open(path) as f:
        for line in f:
            h, r, t = line.strip().split("\t")
            out.append((e2id[h], r2id[r], e2id[t]))
    return torch.tensor(out, dtype=torch.long)


class RotatE(nn.Module):
    def __init__(self, nentity, nrelation, dim, gamma):
        super().__init__()
        self.gamma = nn.Parameter(torch.tensor([gamma]), requires_grad=False)
        self.emb_range = (gamma + 2.0) / dim
        self.entity = nn.Parameter(torch.empty(nentity, 2 * dim).uniform_(-self.emb_range, self.emb_range))
        self.relation = nn.Parameter(torch.empty(nrelation, dim).uniform_(-self.emb_range, self.emb_range))
        self.relation_inv = nn.Parameter(torch.empty(nrelation, dim).uniform_(-self.emb_range, self.emb_range))

    def _rotate(self, src, phase_raw, dst):
        phase = phase_raw / (self.emb_range / math.pi)
        re_s, im_s = src.chunk(2, dim=-1)
        re_d, im_d = dst.chunk(2, dim=-1)
        re_r, im_r = torch.cos(phase), torch.sin(phase)
        re = re_s * re_r - im_s * im_r - re_d
        im = re_s * im_r + im_s * re_r - im_d
        return self.gamma - torch.stack([re, im], dim=0).norm(dim=0).sum(dim=-1)

    def forward(self, pos, neg, mode):
        # tail-batch: corrupt tails, rotate head by r.
        # head-batch: corrupt heads, rotate tail by r^-1.
        if mode == "tail-batch":
            src, phase = self.entity[pos[:, 0]], self.relation[pos[:, 1]]
            true_dst = self.entity[pos[:, 2]]
        else:
            src, phase = self.entity[pos[:, 2]], self.relation_inv[pos[:, 1]]
            true_dst = self.entity[pos[:, 0]]
        pos_score = self._rotate(src, phase, true_dst)
        neg_score = self._rotate(src.unsqueeze(1), phase.unsqueeze(1), self.entity[neg])
        return pos_score, neg_score

    @torch.no_grad()
    def score_all(self, src_idx, rel_idx, mode):
        table = self.relation if mode == "tail-batch" else self.relation_inv
        src = self.entity[src_idx].unsqueeze(1)
        phase = table[rel_idx].unsqueeze(1)
        return self._rotate(src, phase, self.entity.unsqueeze(0))


class NegativeCollate:
    """Stack positives and draw `nneg` uniform negative entities per positive."""

    def __init__(self, nentity, nneg):
        self.nentity, self.nneg = nentity, nneg

    def __call__(self, batch):
        pos = torch.stack([b[0] for b in batch])
        return pos, torch.randint(0, self.nentity, (pos.size(0), self.nneg))


def make_loader(triples, nentity, nneg, bs, rank, world, seed):
    ds = TensorDataset(triples)
    sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True, seed=seed, drop_last=True)
    loader = DataLoader(ds, batch_size=bs, sampler=sampler, collate_fn=NegativeCollate(nentity, nneg),
                        num_workers=2, drop_last=True)
    return loader, sampler


def infinite(loader, sampler):
    epoch = 0
    while True:
        sampler.set_epoch(epoch)
        yield from loader
        epoch += 1


@torch.no_grad()
def test_step(model, triples, all_true, args, device, rank, world):
    model.eval()
    part = triples[rank::world]
    acc = torch.zeros(5, device=device, dtype=torch.float64)
    for start in range(0, part.size(0), args.test_batch_size):
        batch = part[start:start + args.test_batch_size].to(device)
        for mode in ("head-batch", "tail-batch"):
            if mode == "tail-batch":
                src, tgt = batch[:, 0], batch[:, 2]
                keys = [(h, r) for h, r in batch[:, :2].tolist()]
                known = all_true["tail"]
            else:
                src, tgt = batch[:, 2], batch[:, 0]
                keys = [(r, t) for r, t in batch[:, 1:].tolist()]
                known = all_true["head"]
            score = model.score_all(src, batch[:, 1], mode)
            target_score = score.gather(1, tgt.view(-1, 1))
            for i, k in enumerate(keys):
                score[i, known[k]] = -1e9
            ranking = 1 + (score > target_score).sum(dim=1).double()
            acc[0] += (1.0 / ranking).sum()
            acc[1] += ranking.sum()
            acc[2] += (ranking <= 1).sum()
            acc[3] += (ranking <= 10).sum()
            acc[4] += ranking.numel()
    dist.all_reduce(acc)
    n = acc[4].item()
    return {"MRR": acc[0].item() / n, "MR": acc[1].item() / n,
            "HITS@1": acc[2].item() / n, "HITS@10": acc[3].item() / n}


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    logging.basicConfig(format="%(asctime)s %(message)s",
                        level=logging.INFO if rank == 0 else logging.WARNING)
    log = logging.getLogger("rotate")

    e2id = read_dict(os.path.join(args.data_path, "entities.dict"))
    r2id = read_dict(os.path.join(args.data_path, "relations.dict"))
    train = read_triples(os.path.join(args.data_path, "train.txt"), e2id, r2id)
    valid = read_triples(os.path.join(args.data_path, "valid.txt"), e2id, r2id)
    test = read_triples(os.path.join(args.data_path, "test.txt"), e2id, r2id)
    all_true = {"tail": {}, "head": {}}
    for h, r, t in torch.cat([train, valid, test]).tolist():
        all_true["tail"].setdefault((h, r), []).append(t)
        all_true["head"].setdefault((r, t), []).append(h)

    model = RotatE(len(e2id), len(r2id), args.hidden_dim, args.gamma).to(device)
    step = 0
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        model.load_state_dict(ckpt["model"])
        step = ckpt["step"]
    ddp_model = DDP(model, device_ids=[local_rank], find_unused_parameters=True)
    optimizer = torch.optim.Adam([p for p in ddp_model.parameters() if p.requires_grad],
                                 lr=args.learning_rate)
    if args.resume:
        optimizer.load_state_dict(ckpt["optimizer"])

    head_loader, head_sampler = make_loader(train, len(e2id), args.negative_sample_size,
                                            args.batch_size, rank, world, seed=0)
    tail_loader, tail_sampler = make_loader(train, len(e2id), args.negative_sample_size,
                                            args.batch_size, rank, world, seed=1)
    head_iter, tail_iter = infinite(head_loader, head_sampler), infinite(tail_loader, tail_sampler)

    if rank == 0:
        os.makedirs(args.save_path, exist_ok=True)
    running = torch.zeros(2, device=device)
    while step < args.max_steps:
        ddp_model.train()
        mode = "head-batch" if step % 2 == 0 else "tail-batch"
        pos, neg = next(head_iter) if mode == "head-batch" else next(tail_iter)
        pos, neg = pos.to(device, non_blocking=True), neg.to(device, non_blocking=True)
        pos_score, neg_score = ddp_model(pos, neg, mode)
        weights = F.softmax(neg_score * args.adv_temperature, dim=1).detach()
        neg_loss = -(weights * F.logsigmoid(-neg_score)).sum(dim=1).mean()
        pos_loss = -F.logsigmoid(pos_score).mean()
        loss = (pos_loss + neg_loss) / 2
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        step += 1
        running += torch.stack([loss.detach(), torch.ones((), device=device)])

        if step % args.log_steps == 0:
            dist.all_reduce(running)
            log.info("step %d loss %.4f", step, (running[0] / running[1]).item())
            running.zero_()

        if step % args.valid_steps == 0 or step == args.max_steps:
            metrics = test_step(model, valid, all_true, args, device, rank, world)
            log.info("valid @%d %s", step, metrics)
            if rank == 0:
                torch.save({"step": step, "model": model.state_dict(),
                            "optimizer": optimizer.state_dict(), "args": vars(args)},
                           os.path.join(args.save_path, "checkpoint.pt"))
            dist.barrier()

    metrics = test_step(model, test, all_true, args, device, rank, world)
    log.info("test %s", metrics)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
