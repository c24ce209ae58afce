# Meta-Baseline, stage 1: whole-classification pre-training on the 64 base
# classes of mini-ImageNet, with few-shot (nearest-centroid, cosine) validation
# on the 16 validation classes after every epoch.
#
#   torchrun --nproc_per_node=4 04_metabaseline_pretrain.py --data /data/mini-imagenet
import argparse
import os
import os.path as osp
import pickle
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset
from torchvision import transforms
from tqdm import tqdm

MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]


class MiniImageNetPkl(Dataset):
    """The 'mini-imagenet-cache-{split}.pkl' files: {'image_data': N x 84 x 84 x 3, 'class_dict'}."""

    def __init__(self, root, split, train_aug=False):
        with open(osp.join(root, f"mini-imagenet-cache-{split}.pkl"), "rb") as f:
            pack = pickle.load(f)
        self.images = pack["image_data"]
        self.labels = np.zeros(len(self.images), dtype=np.int64)
        for i, name in enumerate(sorted(pack["class_dict"])):
            self.labels[pack["class_dict"][name]] = i
        self.n_classes = len(pack["class_dict"])
        if train_aug:
            self.tf = transforms.Compose([transforms.ToPILImage(), transforms.RandomResizedCrop(80),
                                          transforms.RandomHorizontalFlip(), transforms.ToTensor(),
                                          transforms.Normalize(MEAN, STD)])
        else:
            self.tf = transforms.Compose([transforms.ToPILImage(), transforms.Resize(92),
                                          transforms.CenterCrop(80), transforms.ToTensor(),
                                          transforms.Normalize(MEAN, STD)])

    def __len__(self):
        return len(self.images)

    def __getitem__(self, i):
        return self.tf(self.images[i]), self.labels[i]


class EpisodeBatchSampler:
    def __init__(self, labels, n_batch, n_way, n_per, seed):
        self.n_batch, self.n_way, self.n_per = n_batch, n_way, n_per
        self.catlocs = [np.flatnonzero(labels == c) for c in np.unique(labels)]
        self.rng = np.random.default_rng(seed)

    def __len__(self):
        return self.n_batch

    def __iter__(self):
        for _ in range(self.n_batch):
            classes = self.rng.choice(len(self.catlocs), self.n_way, replace=False)
            yield np.concatenate([self.rng.choice(self.catlocs[c], self.n_per, replace=False)
                                  for c in classes]).tolist()


class Classifier(nn.Module):
    def __init__(self, n_classes):
        super().__init__()
        backbone = torchvision.models.resnet18(weights=None)
        backbone.fc = nn.Identity()
        self.encoder = backbone
        self.fc = nn.Linear(512, n_classes)

    def forward(self, x):
        return self.fc(self.encoder(x))


@torch.no_grad()
def fewshot_eval(encoder, loader, n_way, n_shot, n_query, device):
    encoder.eval()
    accs = []
    for x, _ in loader:
        feats = F.normalize(encoder(x.to(device, non_blocking=True)), dim=-1)
        feats = feats.view(n_way, n_shot + n_query, -1)
        protos = F.normalize(feats[:, :n_shot].mean(1), dim=-1)
        q = feats[:, n_shot:].reshape(-1, feats.size(-1))
        pred = (q @ protos.t()).argmax(1)
        y = torch.arange(n_way, device=device).repeat_interleave(n_query)
        accs.append((pred == y).float().mean())
    encoder.train()
    accs = torch.stack(accs)
    out = torch.stack([accs.sum(), accs.pow(2).sum(), torch.tensor(float(len(accs)), device=device)])
    dist.all_reduce(out)
    mean = out[0] / out[2]
    ci = 1.96 * (out[1] / out[2] - mean ** 2).clamp_min(0).sqrt() / out[2].sqrt()
    return mean.item(), ci.item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--save-dir", default="./save/classifier-mini-resnet18")
    ap.add_argument("--batch-size", type=int, default=128, help="per GPU")
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--weight-decay", type=float, default=5e-4)
    ap.add_argument("--epochs", type=int, default=100)
    ap.add_argument("--milestones", type=int, nargs="+", default=[90])
    ap.add_argument("--val-episodes", type=int, default=200)
    ap.add_argument("--workers", type=int, default=8)
    args = ap.parse_args()

    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    train_set = MiniImageNetPkl(args.data, "train", train_aug=True)
    val_set = MiniImageNetPkl(args.data, "val")
    train_loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    val_loaders = {}
    for shot in (1, 5):
        bs = EpisodeBatchSampler(val_set.labels, args.val_episodes // world_size, 5, shot + 15,
                                 seed=shot * 1000 + rank)
        val_loaders[shot] = DataLoader(val_set, batch_sampler=bs, num_workers=args.workers,
                                       pin_memory=True)

    model = Classifier(train_set.n_classes).to(device)
    model = DistributedDataParallel(model, device_ids=[local_rank])
    # linear scaling rule: lr given for 128 images, global batch is batch_size * world_size
    lr = args.lr * args.batch_size * world_size / 128
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9,
                                weight_decay=args.weight_decay)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, args.milestones, gamma=0.1)

    if rank == 0:
        os.makedirs(args.save_dir, exist_ok=True)
    best = {1: 0.0, 5: 0.0}
    for epoch in range(1, args.epochs + 1):
        t0 = time.time()
        meter = torch.zeros(3, device=device)
        it = tqdm(train_loader, desc=f"epoch {epoch}", disable=rank != 0, leave=False)
        for x, y in it:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            logits = model(x)
            loss = F.cross_entropy(logits, y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            meter += torch.stack([loss.detach() * len(y), (logits.argmax(1) == y).sum().float(),
                                  torch.tensor(float(len(y)), device=device)])
        scheduler.step()
        dist.all_reduce(meter)

        res = {s: fewshot_eval(model.module.encoder, val_loaders[s], 5, s, 15, device)
               for s in (1, 5)}
        if rank == 0:
            print(f"epoch {epoch} | loss {meter[0] / meter[2]:.4f} acc {meter[1] / meter[2]:.4f} | "
                  f"val 1-shot {100 * res[1][0]:.2f}+-{100 * res[1][1]:.2f} "
                  f"5-shot {100 * res[5][0]:.2f}+-{100 * res[5][1]:.2f} | {time.time() - t0:.0f}s",
                  flush=True)
            state = {"epoch": epoch, "encoder": model.module.encoder.state_dict(),
                     "fc": model.module.fc.state_dict(), "optimizer": optimizer.state_dict()}
            torch.save(state, osp.join(args.save_dir, "epoch-last.pth"))
            for s in (1, 5):
                if res[s][0] > best[s]:
                    best[s] = res[s][0]
                    torch.save(state, osp.join(args.save_dir, f"max-va-{s}shot.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
