#!/usr/bin/env python3
# RotatE (Sun et al., ICLR 2019) with self-adversarial negative sampling, multi-GPU DDP.
# Long runs on Wikidata5M get pre-empted, so the script checkpoints every N steps and
# can be restarted with --resume.
import argparse
import logging
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter


def get_parser():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data_path", type=str, required=True)
    parser.add_argument("--save_path", type=str, default="models/RotatE_wikidata5m")
    parser.add_argument("--hidden_dim", type=int, default=512)
    parser.add_argument("--gamma", type=float, default=6.0)
    parser.add_argument("--adversarial_temperature", type=float, default=1.0)
    parser.add_argument("--negative_sample_size", type=int, default=256)
    parser.add_argument("--batch_size", type=int, default=512)
    parser.add_argument("--learning_rate", type=float, default=1e-4)
    parser.add_argument("--max_steps", type=int, default=300000)
    parser.add_argument("--save_every", type=int, default=10000)
    parser.add_argument("--log_every", type=int, default=100)
    parser.add_argument("--num_workers", type=int, default=6)
    parser.add_argument("--resume", type=str, default=None, help="checkpoint to continue from")
    return parser


class TrainDataset(Dataset):
    def __init__(self, triples, nentity, negative_sample_size):
        self.triples = triples
        self.nentity = nentity
        self.k = negative_sample_size

    def __len__(self):
        return len(self.triples)

    def __getitem__(self, idx):
        h, r, t = self.triples[idx]
        negatives = np.random.randint(self.nentity, size=self.k)
        mode = random.random() < 0.5  # True: corrupt head
        return torch.LongTensor([h, r, t]), torch.from_numpy(negatives), mode

    @staticmethod
    def collate(batch):
        pos = torch.stack([b[0] for b in batch])
        neg = torch.stack([b[1] for b in batch])
        head_mode = torch.tensor([b[2] for b in batch])
        return pos, neg, head_mode


def worker_init_fn(worker_id):
    seed = torch.initial_seed() % 2 ** 32
    np.random.seed(seed)
    random.seed(seed)


class RotatE(nn.Module):
    def __init__(self, nentity, nrelation, hidden_dim, gamma):
        super().__init__()
        self.epsilon = 2.0
        self.gamma = gamma
        self.embedding_range = (gamma + self.epsilon) / hidden_dim
        self.entity_embedding = nn.Parameter(torch.empty(nentity, hidden_dim * 2))
        self.relation_embedding = nn.Parameter(torch.empty(nrelation, hidden_dim))
        nn.init.uniform_(self.entity_embedding, -self.embedding_range, self.embedding_range)
        nn.init.uniform_(self.relation_embedding, -self.embedding_range, self.embedding_range)

    def forward(self, pos, neg, head_mode):
        """Returns (positive_score [B], negative_score [B, K])."""
        ent, rel = self.entity_embedding, self.relation_embedding
        h = ent[pos[:, 0]].unsqueeze(1)
        r = rel[pos[:, 1]].unsqueeze(1)
        t = ent[pos[:, 2]].unsqueeze(1)
        n = ent[neg]
        hm = head_mode.view(-1, 1, 1)
        neg_h = torch.where(hm, n, h.expand_as(n))
        neg_t = torch.where(hm, t.expand_as(n), n)
        return self.score(h, r, t).squeeze(1), self.score(neg_h, r, neg_t)

    def score(self, h, r, t):
        pi = 3.14159265358979323846
        re_h, im_h = torch.chunk(h, 2, dim=-1)
        re_t, im_t = torch.chunk(t, 2, dim=-1)
        phase = r / (self.embedding_range / pi)
        re_r, im_r = torch.cos(phase), torch.sin(phase)
        re_s = re_h * re_r - im_h * im_r - re_t
        im_s = re_h * im_r + im_h * re_r - im_t
        dist_ = torch.stack([re_s, im_s], dim=0).norm(dim=0)
        return self.gamma - dist_.sum(dim=-1)


def rotate_loss(pos_score, neg_score, temperature):
    weights = F.softmax(neg_score * temperature, dim=1).detach()
    neg_loss = -(weights * F.logsigmoid(-neg_score)).sum(dim=1)
    pos_loss = -F.logsigmoid(pos_score)
    return ((pos_loss + neg_loss) / 2).mean()


def read_triples(path, entity2id, relation2id):
    triples = []
    with open(path) as fin:
        for line in fin:
            h, r, t = line.strip().split("\t")
            triples.append((entity2id[h], relation2id[r], entity2id[t]))
    return triples


def read_dict(path):
    with open(path) as fin:
        return {name: int(idx) for idx, name in (line.strip().split("\t") for line in fin)}


def save_checkpoint(path, model, optimizer, step):
    torch.save({"step": step, "model_state_dict": model.module.state_dict(),
                "optimizer_state_dict": optimizer.state_dict()}, path)


def infinite(loader, sampler):
    epoch = 0
    while True:
        sampler.set_epoch(epoch)
        for batch in loader:
            yield batch
        epoch += 1


def main():
    args = get_parser().parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    is_main = rank == 0
    device = torch.device("cuda", local_rank)

    logging.basicConfig(format="%(asctime)s %(levelname)-8s %(message)s",
                        level=logging.INFO if is_main else logging.WARN)

    entity2id = read_dict(os.path.join(args.data_path, "entities.dict"))
    relation2id = read_dict(os.path.join(args.data_path, "relations.dict"))
    train_triples = read_triples(os.path.join(args.data_path, "train.txt"), entity2id, relation2id)
    nentity, nrelation = len(entity2id), len(relation2id)
    logging.info("#entity %d  #relation %d  #train %d", nentity, nrelation, len(train_triples))

    model = RotatE(nentity, nrelation, args.hidden_dim, args.gamma).to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.learning_rate)

    start_step = 0
    if args.resume:
        checkpoint = torch.load(args.resume)
        model.module.load_state_dict(checkpoint["model_state_dict"])
        optimizer.load_state_dict(checkpoint["optimizer_state_dict"])
        start_step = checkpoint["step"]
        logging.info("resumed from %s (step %d)", args.resume, start_step)

    dataset = TrainDataset(train_triples, nentity, args.negative_sample_size)
    sampler = DistributedSampler(dataset, shuffle=True)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler,
                        num_workers=args.num_workers, collate_fn=TrainDataset.collate,
                        worker_init_fn=worker_init_fn, pin_memory=True, drop_last=True,
                        persistent_workers=True)
    batches = infinite(loader, sampler)

    writer = SummaryWriter(os.path.join(args.save_path, "tb")) if is_main else None
    if is_main:
        os.makedirs(args.save_path, exist_ok=True)

    model.train()
    tic = time.time()
    for step in range(start_step, args.max_steps):
        pos, neg, head_mode = next(batches)
        pos, neg, head_mode = pos.to(device), neg.to(device), head_mode.to(device)
        pos_score, neg_score = model(pos, neg, head_mode)
        loss = rotate_loss(pos_score, neg_score, args.adversarial_temperature)

        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

        if (step + 1) % args.log_every == 0:
            loss_avg = loss.detach().clone()
            dist.all_reduce(loss_avg)
            loss_avg /= dist.get_world_size()
            if is_main:
                writer.add_scalar("train/loss", loss_avg.item(), step + 1)
                logging.info("step %d loss %.4f  %.1f steps/s", step + 1, loss_avg.item(),
                             args.log_every / (time.time() - tic))
            tic = time.time()

        if (step + 1) % args.save_every == 0:
            if is_main:
                save_checkpoint(os.path.join(args.save_path, f"step_{step + 1}.pt"), model, optimizer, step + 1)
                save_checkpoint(os.path.join(args.save_path, "latest.pt"), model, optimizer, step + 1)
            dist.barrier()

    if is_main:
        save_checkpoint(os.path.join(args.save_path, "final.pt"), model, optimizer, args.max_steps)
        np.save(os.path.join(args.save_path, "entity_embedding.npy"),
                model.module.entity_embedding.detach().cpu().numpy())
        writer.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
