"""
Prototypical networks on tieredImageNet, 5-way {1,5}-shot.

Reports meta-test accuracy as mean +- 95% confidence interval over
`--test-episodes` episodes; the episodes are shared out over the GPUs.

torchrun --nproc_per_node=8 05_protonet_tiered_ci.py --root /data/tiered-imagenet --shot 1
"""
import argparse
import os
import os.path as osp
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.tensorboard import SummaryWriter
from torchvision import transforms


class TieredImageNet(Dataset):
    """Preprocessed npz files: {split}_images.npz (uint8 N x 84 x 84 x 3), {split}_labels.npy."""

    def __init__(self, root, split, aug=False):
        self.images = np.load(osp.join(root, f"{split}_images.npz"))["images"]
        self.labels = np.load(osp.join(root, f"{split}_labels.npy")).astype(np.int64)
        normalize = transforms.Normalize([0.4721, 0.4533, 0.4099], [0.2771, 0.2677, 0.2844])
        if aug:
            self.tf = transforms.Compose([transforms.ToPILImage(), transforms.RandomCrop(84, padding=8),
                                          transforms.RandomHorizontalFlip(), transforms.ToTensor(),
                                          normalize])
        else:
            self.tf = transforms.Compose([transforms.ToTensor(), normalize])

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, idx):
        return self.tf(self.images[idx]), self.labels[idx]


class CategoriesSampler:
    def __init__(self, label, n_batch, n_cls, n_per, seed=0):
        self.n_batch, self.n_cls, self.n_per = n_batch, n_cls, n_per
        label = np.asarray(label)
        self.m_ind = [torch.from_numpy(np.argwhere(label == i).reshape(-1))
                      for i in range(int(label.max()) + 1)]
        self.g = torch.Generator().manual_seed(seed)

    def __len__(self):
        return self.n_batch

    def __iter__(self):
        for _ in range(self.n_batch):
            classes = torch.randperm(len(self.m_ind), generator=self.g)[:self.n_cls]
            batch = []
            for c in classes:
                ind = self.m_ind[c]
                batch.append(ind[torch.randperm(len(ind), generator=self.g)[:self.n_per]])
            yield torch.stack(batch).t().reshape(-1).tolist()


def conv_block(cin, cout):
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout),
                         nn.ReLU(), nn.MaxPool2d(2))


class ConvNet(nn.Module):
    def __init__(self, x_dim=3, hid_dim=64, z_dim=64):
        super().__init__()
        self.encoder = nn.Sequential(conv_block(x_dim, hid_dim), conv_block(hid_dim, hid_dim),
                                     conv_block(hid_dim, hid_dim), conv_block(hid_dim, z_dim))

    def forward(self, x):
        return self.encoder(x).view(x.size(0), -1)


def proto_logits(emb, way, shot):
    p = way * shot
    proto = emb[:p].reshape(shot, way, -1).mean(dim=0)
    return -((emb[p:].unsqueeze(1) - proto.unsqueeze(0)) ** 2).sum(dim=2)


@torch.no_grad()
def evaluate(model, loader, way, shot, query, device):
    model.eval()
    label = torch.arange(way, device=device).repeat(query)
    accs = []
    for data, _ in loader:
        logits = proto_logits(model(data.to(device, non_blocking=True)), way, shot)
        accs.append((logits.argmax(dim=1) == label).float().mean().item())
    model.train()
    accs = np.array(accs)
    return accs.mean(), 1.96 * accs.std() / np.sqrt(len(accs))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", default="/data/tiered-imagenet")
    parser.add_argument("--save-path", default="./save/proto-tiered")
    parser.add_argument("--max-epoch", type=int, default=200)
    parser.add_argument("--episodes", type=int, default=100, help="training episodes per epoch per GPU")
    parser.add_argument("--shot", type=int, default=1)
    parser.add_argument("--query", type=int, default=15)
    parser.add_argument("--train-way", type=int, default=30)
    parser.add_argument("--test-way", type=int, default=5)
    parser.add_argument("--val-episodes", type=int, default=800)
    parser.add_argument("--test-episodes", type=int, default=10000)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--workers", type=int, default=8)
    args = parser.parse_args()

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(1)

    trainset = TieredImageNet(args.root, "train", aug=True)
    valset = TieredImageNet(args.root, "val")
    testset = TieredImageNet(args.root, "test")
    train_loader = DataLoader(
        trainset, num_workers=args.workers, pin_memory=True,
        batch_sampler=CategoriesSampler(trainset.labels, args.episodes, args.train_way,
                                        args.shot + args.query, seed=rank))

    def eval_loader(ds, n, seed):
        sampler = CategoriesSampler(ds.labels, n // world, args.test_way, args.shot + args.query,
                                    seed=seed * 100 + rank)
        return DataLoader(ds, batch_sampler=sampler, num_workers=args.workers, pin_memory=True)

    val_loader = eval_loader(valset, args.val_episodes, 1)

    model = DDP(ConvNet().to(device), device_ids=[local_rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    lr_scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=20, gamma=0.5)

    writer = None
    if rank == 0:
        os.makedirs(args.save_path, exist_ok=True)
        writer = SummaryWriter(args.save_path)

    label = torch.arange(args.train_way, device=device).repeat(args.query)
    best_va, step = 0.0, 0
    for epoch in range(1, args.max_epoch + 1):
        tic = time.time()
        for data, _ in train_loader:
            logits = proto_logits(model(data.to(device, non_blocking=True)), args.train_way, args.shot)
            loss = F.cross_entropy(logits, label)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step += 1
            if rank == 0 and step % 50 == 0:
                writer.add_scalar("train/loss", loss.item(), step)
        lr_scheduler.step()

        va, va_ci = evaluate(model.module, val_loader, args.test_way, args.shot, args.query, device)
        if rank == 0:
            writer.add_scalar("val/acc", va, epoch)
            print(f"epoch {epoch}, val acc {va:.4f} +- {va_ci:.4f}, {time.time() - tic:.1f}s", flush=True)
            torch.save(model.module.state_dict(), osp.join(args.save_path, "epoch-last.pth"))
            if va > best_va:
                best_va = va
                torch.save(model.module.state_dict(), osp.join(args.save_path, "max-acc.pth"))
        dist.barrier()

    state = torch.load(osp.join(args.save_path, "max-acc.pth"), map_location=device)
    model.module.load_state_dict(state)
    test_loader = eval_loader(testset, args.test_episodes, 7)
    acc, ci = evaluate(model.module, test_loader, args.test_way, args.shot, args.query, device)
    if rank == 0:
        print(f"meta-test {args.test_way}-way {args.shot}-shot over {args.test_episodes} episodes: "
              f"{100 * acc:.2f} +- {100 * ci:.2f}")
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
