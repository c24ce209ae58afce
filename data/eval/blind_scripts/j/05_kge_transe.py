# TransE / RotatE style KG embedding training with self-adversarial negative sampling
# torchrun --nproc_per_node=4 05_kge_transe.py --data_path data/FB15k-237 --model TransE -d 1000 -g 9.0
import os
import sys
import json
import logging
import argparse

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.distributed as dist
from torch.utils.data import Dataset, DataLoader
from torch.utils.data.distributed import DistributedSampler
from torch.nn.parallel import DistributedDataParallel as DDP


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description='KGE training')
    parser.add_argument('--data_path', type=str, required=True)
    parser.add_argument('--model', default='TransE', choices=['TransE', 'DistMult'])
    parser.add_argument('-n', '--negative_sample_size', default=256, type=int)
    parser.add_argument('-d', '--hidden_dim', default=1000, type=int)
    parser.add_argument('-g', '--gamma', default=9.0, type=float)
    parser.add_argument('-a', '--adversarial_temperature', default=1.0, type=float)
    parser.add_argument('-b', '--batch_size', default=1024, type=int)
    parser.add_argument('-lr', '--learning_rate', default=0.0001, type=float)
    parser.add_argument('--max_steps', default=100000, type=int)
    parser.add_argument('--valid_steps', default=10000, type=int)
    parser.add_argument('--log_steps', default=100, type=int)
    parser.add_argument('--test_batch_size', default=16, type=int)
    parser.add_argument('-save', '--save_path', default='models/TransE_FB15k237', type=str)
    parser.add_argument('--seed', default=0, type=int)
    return parser.parse_args(argv)


def create_logger(save_path):
    logger = logging.getLogger('kge')
    rank = dist.get_rank()
    if rank == 0:
        os.makedirs(save_path, exist_ok=True)
        logger.setLevel(logging.INFO)
        fh = logging.FileHandler(os.path.join(save_path, 'train.log'))
        sh = logging.StreamHandler(sys.stdout)
        for h in (fh, sh):
            h.setFormatter(logging.Formatter('%(asctime)s %(levelname)s %(message)s'))
            logger.addHandler(h)
    else:
        logger.setLevel(logging.ERROR)
    return logger


def read_triples(path, e2id, r2id):
    out = []
    with open(path) as f:
        for line in f:
            h, r, t = line.strip().split('\t')
            out.append((e2id[h], r2id[r], e2id[t]))
    return out


def read_dict(path):
    d = {}
    with open(path) as f:
        for line in f:
            i, name = line.strip().split('\t')
            d[name] = int(i)
    return d


class TrainDataset(Dataset):
    def __init__(self, triples, nentity, neg_size):
        self.triples = triples
        self.nentity = nentity
        self.neg = neg_size

    def __len__(self):
        return len(self.triples)

    def __getitem__(self, idx):
        h, r, t = self.triples[idx]
        neg = np.random.randint(self.nentity, size=self.neg)
        mode = np.random.randint(2)  # 0 corrupt head, 1 corrupt tail
        return torch.LongTensor([h, r, t]), torch.from_numpy(neg), mode


class KGEModel(nn.Module):
    def __init__(self, model_name, nentity, nrelation, dim, gamma):
        super().__init__()
        self.model_name = model_name
        self.gamma = nn.Parameter(torch.Tensor([gamma]), requires_grad=False)
        self.rng = (gamma + 2.0) / dim
        self.entity_embedding = nn.Parameter(torch.zeros(nentity, dim))
        self.relation_embedding = nn.Parameter(torch.zeros(nrelation, dim))
        nn.init.uniform_(self.entity_embedding, -self.rng, self.rng)
        nn.init.uniform_(self.relation_embedding, -self.rng, self.rng)

    def score(self, h, r, t):
        if self.model_name == 'TransE':
            return self.gamma.item() - torch.norm(h + r - t, p=1, dim=-1)
        return (h * r * t).sum(-1)

    def forward(self, pos, neg, mode):
        h = self.entity_embedding[pos[:, 0]].unsqueeze(1)
        r = self.relation_embedding[pos[:, 1]].unsqueeze(1)
        t = self.entity_embedding[pos[:, 2]].unsqueeze(1)
        pos_score = self.score(h, r, t).squeeze(1)
        ne = self.entity_embedding[neg]
        head_mode = (mode == 0).view(-1, 1, 1)
        neg_score = self.score(torch.where(head_mode, ne, h), r, torch.where(head_mode, t, ne))
        return pos_score, neg_score


def loss_fn(pos_score, neg_score, temp):
    neg_w = F.softmax(neg_score * temp, dim=1).detach()
    neg_loss = -(neg_w * F.logsigmoid(-neg_score)).sum(1).mean()
    pos_loss = -F.logsigmoid(pos_score).mean()
    return (pos_loss + neg_loss) / 2, pos_loss, neg_loss


@torch.no_grad()
def evaluate(model, triples, nentity, args, device):
    """filtered-free quick MRR on a shard of the triples (tail prediction)."""
    model.eval()
    rank, world = dist.get_rank(), dist.get_world_size()
    shard = torch.LongTensor(triples[rank::world]).to(device)
    all_e = torch.arange(nentity, device=device)
    stats = torch.zeros(3, device=device)  # sum rr, hits@10, count
    for i in range(0, shard.size(0), args.test_batch_size):
        b = shard[i:i + args.test_batch_size]
        h = model.entity_embedding[b[:, 0]].unsqueeze(1)
        r = model.relation_embedding[b[:, 1]].unsqueeze(1)
        t_all = model.entity_embedding[all_e].unsqueeze(0)
        s = model.score(h, r, t_all)
        true = s.gather(1, b[:, 2:3])
        ranks = (s > true).sum(1).float() + 1
        stats += torch.stack([(1.0 / ranks).sum(), (ranks <= 10).float().sum(), torch.tensor(float(b.size(0)), device=device)])
    dist.all_reduce(stats)
    return {'MRR': (stats[0] / stats[2]).item(), 'HITS@10': (stats[1] / stats[2]).item()}


def main():
    args = parse_args()
    torch.manual_seed(args.seed)
    np.random.seed(args.seed)
    logger = create_logger(args.save_path)

    local_rank = int(os.environ['LOCAL_RANK'])
    torch.cuda.set_device(local_rank)
    dist.init_process_group('nccl')
    device = torch.device('cuda', local_rank)
    world = dist.get_world_size()

    e2id = read_dict(os.path.join(args.data_path, 'entities.dict'))
    r2id = read_dict(os.path.join(args.data_path, 'relations.dict'))
    train = read_triples(os.path.join(args.data_path, 'train.txt'), e2id, r2id)
    valid = read_triples(os.path.join(args.data_path, 'valid.txt'), e2id, r2id)
    nentity, nrelation = len(e2id), len(r2id)
    logger.info('#entity %d #relation %d #train %d world %d', nentity, nrelation, len(train), world)

    ds = TrainDataset(train, nentity, args.negative_sample_size)
    sampler = DistributedSampler(ds, shuffle=True, seed=args.seed)
    loader = DataLoader(ds, batch_size=args.batch_size // world, sampler=sampler, num_workers=4,
                        drop_last=True, worker_init_fn=lambda w: np.random.seed(args.seed + 1000 * local_rank + w))

    model = KGEModel(args.model, nentity, nrelation, args.hidden_dim, args.gamma).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=args.learning_rate)

    step, epoch = 0, 0
    logs = []
    while step < args.max_steps:
        sampler.set_epoch(epoch)
        model.train()
        for pos, neg, mode in loader:
            pos, neg, mode = pos.to(device), neg.to(device), mode.to(device)
            pos_score, neg_score = model(pos, neg, mode)
            loss, pl, nl = loss_fn(pos_score, neg_score, args.adversarial_temperature)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            logs.append(loss.item())
            step += 1
            if step % args.log_steps == 0:
                avg = torch.tensor(np.mean(logs), device=device)
                dist.all_reduce(avg)
                logger.info('step %d loss %.4f', step, avg.item() / world)
                logs = []
            if step % args.valid_steps == 0:
                metrics = evaluate(model.module, valid, nentity, args, device)
                logger.info('valid step %d %s', step, json.dumps(metrics))
                if dist.get_rank() == 0:
                    torch.save({'step': step, 'model': model.module.state_dict(),
                                'optimizer': optimizer.state_dict()}, os.path.join(args.save_path, 'checkpoint'))
                model.train()
            if step >= args.max_steps:
                break
        epoch += 1

    dist.destroy_process_group()


if __name__ == '__main__':
    main()
