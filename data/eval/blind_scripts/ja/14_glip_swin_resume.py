"""GLIP (Swin-B) prompt-based detection training on COCO, preemption-safe.

The job runs on a preemptible queue, so it checkpoints every --ckpt-every
iterations and resumes from the newest checkpoint when restarted.

    torchrun --nproc_per_node=8 14_glip_swin_resume.py --work-dir /nfs/exp/glip_b_coco --auto-resume
"""
import argparse
import glob
import itertools
import os
import re
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision.transforms.v2 as T
from pycocotools.cocoeval import COCOeval
from scipy.optimize import linear_sum_assignment
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision.datasets import CocoDetection, wrap_dataset_for_transforms_v2
from torchvision.models import swin_b, Swin_B_Weights
from torchvision.ops import box_convert, generalized_box_iou, sigmoid_focal_loss
from transformers import AutoModel, AutoTokenizer


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--coco", default="/nfs/datasets/coco")
    p.add_argument("--work-dir", default="/nfs/exp/glip_b_coco")
    p.add_argument("--auto-resume", action="store_true")
    p.add_argument("--resume", default="")
    p.add_argument("--max-iter", type=int, default=90000)
    p.add_argument("--ckpt-every", type=int, default=2500)
    p.add_argument("--eval-every", type=int, default=10000)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--lr", type=float, default=5e-5, help="for 16 images per step")
    p.add_argument("--workers", type=int, default=6)
    return p.parse_args()


class Trainer:
    def __init__(self, args):
        self.args = args
        self.local_rank = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(self.local_rank)
        dist.init_process_group("nccl")
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.device = torch.device("cuda", self.local_rank)
        self.tok = AutoTokenizer.from_pretrained("bert-base-uncased")
        self._build_data()
        self._build_model()
        self.iter = 0

    def _dataset(self, split, train):
        tf = [T.RandomHorizontalFlip()] if train else []
        tf += [T.Resize(800, max_size=1333), T.ToImage(), T.ToDtype(torch.float32, scale=True),
               T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225]), T.SanitizeBoundingBoxes()]
        ds = CocoDetection(os.path.join(self.args.coco, f"{split}2017"),
                           os.path.join(self.args.coco, "annotations", f"instances_{split}2017.json"),
                           transforms=T.Compose(tf))
        return wrap_dataset_for_transforms_v2(ds, target_keys=["image_id", "boxes", "labels"])

    def _build_data(self):
        self.train_set = self._dataset("train", True)
        self.val_set = self._dataset("val", False)
        coco = self.val_set.coco
        self.cat_ids = sorted(coco.getCatIds())
        names = [coco.loadCats(c)[0]["name"] for c in self.cat_ids]
        self.prompt = ". ".join(names) + "."
        enc = self.tok(self.prompt, padding="max_length", max_length=256, return_tensors="pt")
        self.ids, self.am = enc.input_ids.to(self.device), enc.attention_mask.to(self.device)
        tm, pos = torch.zeros(len(names), 256), 0
        for i, n in enumerate(names):
            s = self.prompt.index(n, pos)
            pos = s + len(n)
            tm[i, enc.char_to_token(s): enc.char_to_token(pos - 1) + 1] = 1
        self.token_map = tm.to(self.device)
        self.label_of = {c: i for i, c in enumerate(self.cat_ids)}
        self.train_sampler = DistributedSampler(self.train_set, shuffle=True, drop_last=True)
        self.train_loader = DataLoader(self.train_set, self.args.batch_size, sampler=self.train_sampler,
                                       num_workers=self.args.workers, collate_fn=self._collate, pin_memory=True)
        self.val_loader = DataLoader(self.val_set, 2, sampler=DistributedSampler(self.val_set, shuffle=False),
                                     num_workers=self.args.workers, collate_fn=self._collate)

    def _collate(self, batch):
        imgs, tgts = zip(*batch)
        H, W = max(i.shape[-2] for i in imgs), max(i.shape[-1] for i in imgs)
        x = torch.zeros(len(imgs), 3, H, W)
        out = []
        for k, (im, t) in enumerate(zip(imgs, tgts)):
            x[k, :, : im.shape[-2], : im.shape[-1]] = im
            h, w = im.shape[-2:]
            b = torch.as_tensor(t.get("boxes", torch.zeros(0, 4)), dtype=torch.float32)
            out.append({"image_id": t["image_id"],
                        "boxes": box_convert(b, "xyxy", "cxcywh") / torch.tensor([w, h, w, h]),
                        "labels": torch.tensor([self.label_of[int(c)] for c in t.get("labels", [])], dtype=torch.long)})
        return x, out

    def _build_model(self):
        self.model = GLIPB().to(self.device)
        self.ddp = DDP(self.model, device_ids=[self.local_rank])
        lr = self.args.lr * self.args.batch_size * self.world / 16
        self.opt = torch.optim.AdamW([
            {"params": [p for n, p in self.model.named_parameters() if n.startswith("lang")], "lr": lr * 0.1},
            {"params": [p for n, p in self.model.named_parameters() if not n.startswith("lang")]},
        ], lr=lr, weight_decay=0.05)
        self.sched = torch.optim.lr_scheduler.MultiStepLR(self.opt, [int(self.args.max_iter * 0.67),
                                                                     int(self.args.max_iter * 0.89)])

    # ---------------------------------------------------------------- checkpoints
    def latest_checkpoint(self):
        files = glob.glob(os.path.join(self.args.work_dir, "model_*.pth"))
        if not files:
            return None
        return max(files, key=lambda f: int(re.search(r"model_(\d+)\.pth", f).group(1)))

    def save(self):
        if self.rank != 0:
            return
        os.makedirs(self.args.work_dir, exist_ok=True)
        path = os.path.join(self.args.work_dir, f"model_{self.iter:07d}.pth")
        torch.save({"model": self.model.state_dict(), "optimizer": self.opt.state_dict(),
                    "scheduler": self.sched.state_dict(), "iteration": self.iter}, path + ".tmp")
        os.replace(path + ".tmp", path)

    def resume(self):
        path = self.args.resume or (self.latest_checkpoint() if self.args.auto_resume else None)
        if not path:
            return
        ckpt = torch.load(path)
        self.model.load_state_dict(ckpt["model"])
        self.opt.load_state_dict(ckpt["optimizer"])
        self.sched.load_state_dict(ckpt["scheduler"])
        self.iter = ckpt["iteration"]
        if self.rank == 0:
            print(f"resumed from {path} at iteration {self.iter}", flush=True)

    # ---------------------------------------------------------------- train / eval
    def loss(self, logits, boxes, tgts):
        n = torch.tensor(float(sum(len(t["labels"]) for t in tgts)), device=self.device)
        dist.all_reduce(n)
        n = (n / self.world).clamp(min=1)
        norm_map = self.token_map / self.token_map.sum(-1, keepdim=True)
        tmap, lb = torch.zeros_like(logits), logits.new_zeros(())
        for b, t in enumerate(tgts):
            if len(t["labels"]) == 0:
                continue
            tb, tl = t["boxes"].to(self.device), t["labels"].to(self.device)
            with torch.no_grad():
                C = -2 * (logits[b].sigmoid() @ norm_map.T)[:, tl] + 5 * torch.cdist(boxes[b], tb, p=1) \
                    - 2 * generalized_box_iou(box_convert(boxes[b], "cxcywh", "xyxy"), box_convert(tb, "cxcywh", "xyxy"))
                r, c = linear_sum_assignment(C.cpu())
            tmap[b, r] = self.token_map[tl[c]]
            lb = lb + 5 * F.l1_loss(boxes[b, r], tb[c], reduction="sum") + 2 * (1 - generalized_box_iou(
                box_convert(boxes[b, r], "cxcywh", "xyxy"), box_convert(tb[c], "cxcywh", "xyxy")).diag()).sum()
        return (sigmoid_focal_loss(logits, tmap, reduction="sum") + lb) / n

    @torch.no_grad()
    def evaluate(self):
        self.model.eval()
        coco = self.val_set.coco
        norm_map = self.token_map / self.token_map.sum(-1, keepdim=True)
        dets = []
        for x, tgts in self.val_loader:
            B = x.shape[0]
            logits, boxes = self.model(x.to(self.device), self.ids.expand(B, -1), self.am.expand(B, -1))
            prob = logits.sigmoid() @ norm_map.T
            for b, t in enumerate(tgts):
                info = coco.loadImgs(t["image_id"])[0]
                s, idx = prob[b].flatten().topk(100)
                q, c = idx // prob.shape[-1], idx % prob.shape[-1]
                wh = torch.tensor([info["width"], info["height"]] * 2, device=self.device)
                xywh = box_convert(boxes[b, q], "cxcywh", "xywh") * wh
                dets += [{"image_id": t["image_id"], "category_id": self.cat_ids[ci], "bbox": bb, "score": sc}
                         for sc, ci, bb in zip(s.tolist(), c.tolist(), xywh.tolist())]
        parts = [None] * self.world
        dist.all_gather_object(parts, dets)
        self.model.train()
        if self.rank != 0:
            return None
        uniq = {(d["image_id"], d["category_id"], tuple(d["bbox"])): d for d in itertools.chain(*parts)}
        ev = COCOeval(coco, coco.loadRes(list(uniq.values())), "bbox")
        ev.evaluate()
        ev.accumulate()
        ev.summarize()
        return ev.stats[0]

    def train(self):
        self.resume()
        epoch = self.iter // len(self.train_loader)
        self.ddp.train()
        t0 = time.time()
        while self.iter < self.args.max_iter:
            self.train_sampler.set_epoch(epoch)
            for x, tgts in self.train_loader:
                B = x.shape[0]
                logits, boxes = self.ddp(x.to(self.device, non_blocking=True), self.ids.expand(B, -1), self.am.expand(B, -1))
                loss = self.loss(logits, boxes, tgts)
                self.opt.zero_grad(set_to_none=True)
                loss.backward()
                nn.utils.clip_grad_norm_(self.ddp.parameters(), 0.1)
                self.opt.step()
                self.sched.step()
                self.iter += 1
                if self.iter % 20 == 0:
                    l = loss.detach().clone()
                    dist.all_reduce(l, op=dist.ReduceOp.AVG)
                    if self.rank == 0:
                        print(f"iter {self.iter}/{self.args.max_iter} loss {l.item():.4f} "
                              f"{(time.time() - t0) / 20:.2f}s/it", flush=True)
                        t0 = time.time()
                if self.iter % self.args.ckpt_every == 0:
                    self.save()
                    dist.barrier()
                if self.iter % self.args.eval_every == 0:
                    ap = self.evaluate()
                    if self.rank == 0:
                        print(f"iter {self.iter} COCO AP {ap:.4f}", flush=True)
                if self.iter >= self.args.max_iter:
                    break
            epoch += 1
        self.save()
        dist.barrier()
        dist.destroy_process_group()


class GLIPB(nn.Module):
    def __init__(self, d=256, nq=900):
        super().__init__()
        self.backbone = swin_b(weights=Swin_B_Weights.IMAGENET1K_V1).features
        self.vproj = nn.Linear(1024, d)
        self.lang = AutoModel.from_pretrained("bert-base-uncased", add_pooling_layer=False)
        self.lproj = nn.Linear(768, d)
        self.fuse = nn.ModuleList(nn.MultiheadAttention(d, 8, batch_first=True) for _ in range(6))
        self.queries = nn.Embedding(nq, d)
        self.decoder = nn.TransformerDecoder(nn.TransformerDecoderLayer(d, 8, 2048, batch_first=True), 6)
        self.bbox = nn.Sequential(nn.Linear(d, d), nn.ReLU(), nn.Linear(d, 4))

    def forward(self, x, ids, am):
        v = self.vproj(self.backbone(x).flatten(1, 2))
        t = self.lproj(self.lang(input_ids=ids, attention_mask=am).last_hidden_state)
        pad = ~am.bool()
        for attn in self.fuse:
            v = v + attn(v, t, t, key_padding_mask=pad)[0]
        hs = self.decoder(self.queries.weight.expand(x.shape[0], -1, -1), v)
        logits = (hs @ t.transpose(1, 2) / 16.0).masked_fill(pad[:, None], -1e4)
        return logits, self.bbox(hs).sigmoid()


if __name__ == "__main__":
    Trainer(parse_args()).train()
