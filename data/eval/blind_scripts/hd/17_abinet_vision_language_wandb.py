"""
ABINet-style recognizer: vision model (ResNet + transformer + position attention) followed by a
bidirectional cloze language model and a gated fusion; all three branches are supervised.

    torchrun --nproc_per_node=8 17_abinet_vision_language_wandb.py \
        --train-lmdb /data/str/mj_st --val-lmdb /data/str/benchmarks_6 --wandb-project str-abinet
"""
import argparse
import io
import os

import lmdb
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import wandb
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms
from torchvision.models.resnet import BasicBlock

CHARS = "abcdefghijklmnopqrstuvwxyz1234567890"
NULL = 0  # index 0 doubles as padding / end-of-text for the position-attention decoder
MAX_T = 26


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--train-lmdb", required=True)
    p.add_argument("--val-lmdb", required=True)
    p.add_argument("--batch-size", type=int, default=96)
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--wandb-project", default="str-abinet")
    p.add_argument("--run-name", default=None)
    p.add_argument("--out", default="checkpoints/abinet")
    return p.parse_args()


class LmdbText(Dataset):
    def __init__(self, root, train):
        self.root = root
        with lmdb.open(root, readonly=True, lock=False).begin() as t:
            self.n = int(t.get(b"num-samples"))
        self.env = None
        aug = [transforms.RandomAffine(8, shear=10, scale=(0.8, 1.1)), transforms.ColorJitter(0.4, 0.4, 0.4)]
        self.tf = transforms.Compose((aug if train else []) + [
            transforms.Resize((32, 128)), transforms.ToTensor(),
            transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if self.env is None:
            self.env = lmdb.open(self.root, readonly=True, lock=False, readahead=False)
        with self.env.begin() as t:
            label = t.get(b"label-%09d" % (i + 1)).decode().lower()
            img = Image.open(io.BytesIO(t.get(b"image-%09d" % (i + 1)))).convert("RGB")
        label = "".join(c for c in label if c in CHARS)[: MAX_T - 1]
        y = torch.zeros(MAX_T, dtype=torch.long)
        y[: len(label)] = torch.tensor([CHARS.index(c) + 1 for c in label], dtype=torch.long)
        return self.tf(img), y, len(label) + 1, label


class ResNet45(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Sequential(nn.Conv2d(3, 32, 3, 1, 1, bias=False), nn.BatchNorm2d(32), nn.ReLU(True))
        cfg = [(32, 3, 2), (64, 4, 1), (128, 6, 2), (256, 6, 1), (512, 3, 1)]
        layers, cin = [], 32
        for cout, n, s in cfg:
            down = nn.Sequential(nn.Conv2d(cin, cout, 1, s, bias=False), nn.BatchNorm2d(cout))
            layers.append(nn.Sequential(BasicBlock(cin, cout, s, down), *[BasicBlock(cout, cout) for _ in range(n - 1)]))
            cin = cout
        self.layers = nn.Sequential(*layers)

    def forward(self, x):
        return self.layers(self.conv1(x))  # B, 512, 8, 32


class PositionAttention(nn.Module):
    def __init__(self, d=512):
        super().__init__()
        self.pos = nn.Embedding(MAX_T, d)
        self.k_enc = nn.Sequential(nn.Conv2d(d, 64, 3, 2, 1), nn.BatchNorm2d(64), nn.ReLU(True),
                                   nn.Conv2d(64, 64, 3, 1, 1), nn.BatchNorm2d(64), nn.ReLU(True))
        self.k_dec = nn.Sequential(nn.Upsample(scale_factor=2, mode="nearest"), nn.Conv2d(64, d, 3, 1, 1),
                                   nn.BatchNorm2d(d), nn.ReLU(True))
        self.q = nn.Linear(d, d)

    def forward(self, feat):
        b, c, h, w = feat.shape
        k = self.k_dec(self.k_enc(feat)) + feat
        q = self.q(self.pos.weight).unsqueeze(0).expand(b, -1, -1)        # B, T, C
        att = torch.softmax(q @ k.flatten(2) / c ** 0.5, -1)               # B, T, HW
        return att @ feat.flatten(2).transpose(1, 2)                        # B, T, C


class VisionModel(nn.Module):
    def __init__(self, d=512, n_cls=len(CHARS) + 1):
        super().__init__()
        self.backbone = ResNet45()
        enc = nn.TransformerEncoderLayer(d, 8, 2048, 0.1, batch_first=True)
        self.trans = nn.TransformerEncoder(enc, 3)
        self.pos2d = nn.Parameter(torch.zeros(1, 8 * 32, d))
        self.att = PositionAttention(d)
        self.cls = nn.Linear(d, n_cls)

    def forward(self, x):
        f = self.backbone(x)
        b, c, h, w = f.shape
        t = self.trans(f.flatten(2).transpose(1, 2) + self.pos2d).transpose(1, 2).reshape(b, c, h, w)
        feat = self.att(t)
        return feat, self.cls(feat)


class LanguageModel(nn.Module):
    """Bidirectional cloze network over the vision probabilities."""

    def __init__(self, d=512, n_cls=len(CHARS) + 1):
        super().__init__()
        self.proj = nn.Linear(n_cls, d, bias=False)
        self.pos = nn.Parameter(torch.zeros(1, MAX_T, d))
        layer = nn.TransformerDecoderLayer(d, 8, 2048, 0.1, batch_first=True)
        self.dec = nn.TransformerDecoder(layer, 4)
        self.cls = nn.Linear(d, n_cls)

    def forward(self, probs):
        tokens = self.proj(probs)
        q = self.pos.expand(probs.size(0), -1, -1)
        diag = torch.eye(MAX_T, device=probs.device, dtype=torch.bool)
        mask = torch.zeros(MAX_T, MAX_T, device=probs.device).masked_fill(diag, float("-inf"))
        feat = self.dec(q, tokens, memory_mask=mask)
        return feat, self.cls(feat)


class ABINet(nn.Module):
    def __init__(self, d=512):
        super().__init__()
        self.vision = VisionModel(d)
        self.language = LanguageModel(d)
        self.gate = nn.Linear(2 * d, d)
        self.cls = nn.Linear(d, len(CHARS) + 1)

    def forward(self, x):
        v_feat, v_logits = self.vision(x)
        l_feat, l_logits = self.language(torch.softmax(v_logits, -1).detach())
        g = torch.sigmoid(self.gate(torch.cat([v_feat, l_feat], -1)))
        a_logits = self.cls(g * v_feat + (1 - g) * l_feat)
        return v_logits, l_logits, a_logits


def seq_ce(logits, y, lengths):
    mask = torch.arange(MAX_T, device=y.device)[None] < lengths[:, None]
    return F.cross_entropy(logits[mask], y[mask])


def to_text(logits):
    out = []
    for row in logits.argmax(-1).tolist():
        s = []
        for k in row:
            if k == NULL:
                break
            s.append(CHARS[k - 1])
        out.append("".join(s))
    return out


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    c = torch.zeros(2, device=device)
    for img, _, _, labels in loader:
        _, _, a = model(img.to(device))
        c[0] += sum(p == l for p, l in zip(to_text(a), labels))
        c[1] += len(labels)
    dist.all_reduce(c)
    model.train()
    return (c[0] / c[1]).item()


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    wandb.init(project=args.wandb_project, name=args.run_name, config=vars(args))

    train_ds, val_ds = LmdbText(args.train_lmdb, True), LmdbText(args.val_lmdb, False)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, args.batch_size, sampler=sampler, num_workers=8, pin_memory=True, drop_last=True)
    val_dl = DataLoader(torch.utils.data.Subset(val_ds, range(rank, len(val_ds), world)), 256, num_workers=4)

    model = DDP(ABINet().to(device), device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[6, 8], gamma=0.1)

    step, best = 0, 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for img, y, lengths, _ in train_dl:
            img, y, lengths = img.to(device, non_blocking=True), y.to(device), lengths.to(device)
            v, l, a = model(img)
            loss_v, loss_l, loss_a = seq_ce(v, y, lengths), seq_ce(l, y, lengths), seq_ce(a, y, lengths)
            loss = loss_v + loss_l + loss_a
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 20.0)
            opt.step()
            step += 1
            if step % 100 == 0:
                wandb.log({"loss/total": loss.item(), "loss/vision": loss_v.item(), "loss/language": loss_l.item(),
                           "loss/alignment": loss_a.item(), "lr": opt.param_groups[0]["lr"]}, step=step)
        sched.step()
        acc = evaluate(model.module, val_dl, device)
        wandb.log({"val/word_acc": acc, "epoch": epoch}, step=step)
        if rank == 0:
            print(f"epoch {epoch} val acc {acc:.4f}", flush=True)
            os.makedirs(args.out, exist_ok=True)
            torch.save(model.module.state_dict(), os.path.join(args.out, "last.pth"))
            if acc > best:
                best = acc
                torch.save(model.module.state_dict(), os.path.join(args.out, "best.pth"))
        dist.barrier()

    wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
