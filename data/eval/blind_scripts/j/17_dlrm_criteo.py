"""DLRM-style CTR model on Criteo Kaggle (preprocessed day splits, hashed categorical ids).

torchrun --nproc_per_node=8 17_dlrm_criteo.py --data data/criteo_kaggle --bs 2048 --epochs 2
"""
import os
import time
import argparse

import numpy as np
import torch
import torch.nn as nn
import torch.distributed as dist
from torch.utils.data import Dataset, DataLoader
from torch.utils.data.distributed import DistributedSampler
from torch.nn.parallel import DistributedDataParallel as DDP
from sklearn.metrics import roc_auc_score

p = argparse.ArgumentParser()
p.add_argument('--data', default='data/criteo_kaggle')
p.add_argument('--emb_dim', type=int, default=16)
p.add_argument('--hash_size', type=int, default=200000)
p.add_argument('--bot_mlp', default='13-512-256-64-16')
p.add_argument('--top_mlp', default='512-256-1')
p.add_argument('--bs', type=int, default=2048, help='per-rank mini-batch')
p.add_argument('--lr', type=float, default=0.1)
p.add_argument('--epochs', type=int, default=2)
p.add_argument('--eval_every', type=int, default=5000)
p.add_argument('--print_every', type=int, default=200)
p.add_argument('--save', default='dlrm_ckpt.pt')
args = p.parse_args()

N_DENSE, N_SPARSE = 13, 26


class CriteoNpz(Dataset):
    def __init__(self, path, hash_size):
        d = np.load(path)
        self.dense = np.log1p(np.maximum(d['X_int'], 0)).astype(np.float32)
        self.sparse = (d['X_cat'] % hash_size).astype(np.int64)
        self.y = d['y'].astype(np.float32)

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.dense[i], self.sparse[i], self.y[i]


def mlp(spec, sigmoid_last=False):
    dims = [int(x) for x in spec.split('-')]
    layers = []
    for i in range(len(dims) - 1):
        layers.append(nn.Linear(dims[i], dims[i + 1]))
        if i < len(dims) - 2 or not sigmoid_last:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class DLRM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.ModuleList([nn.Embedding(args.hash_size, args.emb_dim) for _ in range(N_SPARSE)])
        for e in self.emb:
            nn.init.uniform_(e.weight, -np.sqrt(1 / args.hash_size), np.sqrt(1 / args.hash_size))
        self.bot = mlp(args.bot_mlp)
        n_feat = N_SPARSE + 1
        n_inter = n_feat * (n_feat - 1) // 2
        top_in = args.emb_dim + n_inter
        self.top = mlp('%d-%s' % (top_in, args.top_mlp), sigmoid_last=True)
        li, lj = torch.tril_indices(n_feat, n_feat, offset=-1)
        self.register_buffer('li', li, persistent=False)
        self.register_buffer('lj', lj, persistent=False)

    def forward(self, dense, sparse):
        x = self.bot(dense)
        ly = [e(sparse[:, k]) for k, e in enumerate(self.emb)]
        T = torch.stack([x] + ly, 1)
        Z = torch.bmm(T, T.transpose(1, 2))
        inter = Z[:, self.li, self.lj]
        return self.top(torch.cat([x, inter], 1)).squeeze(1)


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    bce = nn.BCEWithLogitsLoss(reduction='sum')
    loss_sum, correct, n = 0.0, 0, 0
    preds, labels = [], []
    for dense, sparse, y in loader:
        logit = model(dense.to(device), sparse.to(device))
        y = y.to(device)
        loss_sum += bce(logit, y).item()
        correct += ((logit > 0).float() == y).sum().item()
        n += y.numel()
        preds.append(torch.sigmoid(logit).cpu().numpy())
        labels.append(y.cpu().numpy())
    stats = torch.tensor([loss_sum, correct, n], dtype=torch.float64)
    dist.all_reduce(stats)
    # AUC needs all predictions: gather the numpy arrays as objects
    local = (np.concatenate(preds), np.concatenate(labels))
    everything = [None] * dist.get_world_size()
    dist.all_gather_object(everything, local)
    auc = roc_auc_score(np.concatenate([e[1] for e in everything]), np.concatenate([e[0] for e in everything]))
    model.train()
    return stats[0].item() / stats[2].item(), stats[1].item() / stats[2].item(), auc


def main():
    local_rank = int(os.environ['LOCAL_RANK'])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend='nccl')
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device('cuda', local_rank)

    train_ds = CriteoNpz(os.path.join(args.data, 'train.npz'), args.hash_size)
    test_ds = CriteoNpz(os.path.join(args.data, 'test.npz'), args.hash_size)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=123)
    train_loader = DataLoader(train_ds, batch_size=args.bs, sampler=sampler, num_workers=4, pin_memory=True,
                              drop_last=True)
    test_sub = torch.utils.data.Subset(test_ds, np.array_split(np.arange(len(test_ds)), world)[rank])
    test_loader = DataLoader(test_sub, batch_size=16384, num_workers=4, pin_memory=True)

    torch.manual_seed(123)
    model = DLRM().to(device)
    model = DDP(model, device_ids=[local_rank], gradient_as_bucket_view=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    loss_fn = nn.BCEWithLogitsLoss()
    if rank == 0:
        print('train %d test %d, %d ranks x %d = global batch %d' % (len(train_ds), len(test_ds), world, args.bs,
                                                                     world * args.bs))

    step, best_auc = 0, 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        for dense, sparse, y in train_loader:
            dense, sparse, y = dense.to(device, non_blocking=True), sparse.to(device, non_blocking=True), \
                y.to(device, non_blocking=True)
            loss = loss_fn(model(dense, sparse), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1
            if step % args.print_every == 0 and rank == 0:
                print('epoch %d step %d loss %.5f  %.2f ms/it' % (epoch, step, loss.item(),
                                                                 1000 * (time.time() - t0) / args.print_every),
                      flush=True)
                t0 = time.time()
            if step % args.eval_every == 0:
                vloss, acc, auc = evaluate(model.module, test_loader, device)
                if rank == 0:
                    print('  [eval] step %d logloss %.5f acc %.4f auc %.4f' % (step, vloss, acc, auc), flush=True)
                    if auc > best_auc:
                        best_auc = auc
                        torch.save(model.module.state_dict(), args.save)
                t0 = time.time()
    dist.destroy_process_group()


if __name__ == '__main__':
    main()
