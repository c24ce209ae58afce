"""Frame-pair training for online video instance segmentation (MinVIS / IDOL style).

Training samples a key frame and a reference frame from the same YouTube-VIS video.
The key frame gets the usual set-prediction losses; the reference frame is only used
for the contrastive track-embedding loss between instances present in both frames.
Inference runs frame by frame and links queries across frames with Hungarian matching
on the embeddings, then writes results.json for the YouTube-VIS server.
"""
import argparse
import json
import os
import random
import time

import numpy as np
import pycocotools.mask as mask_util
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from PIL import Image
from scipy.optimize import linear_sum_assignment
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

MEAN = torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1)
STD = torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1)


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ytvis-root", default="/datasets/ytvis_2021")
    ap.add_argument("--output-dir", default="output/minvis_r50")
    ap.add_argument("--num-classes", type=int, default=40)
    ap.add_argument("--num-queries", type=int, default=100)
    ap.add_argument("--batch-size", type=int, default=4, help="frame pairs per GPU")
    ap.add_argument("--iters", type=int, default=40000)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--ref-range", type=int, default=10)
    ap.add_argument("--size", type=int, default=480)
    ap.add_argument("--eval-only", action="store_true")
    ap.add_argument("--weights", default="")
    return ap.parse_args()


def load_frame(path, size):
    img = Image.open(path).convert("RGB")
    img = img.resize((size * img.width // img.height, size), Image.BILINEAR)
    return (torch.from_numpy(np.asarray(img)).permute(2, 0, 1).float() / 255.0 - MEAN) / STD


class YTVISPairs(Dataset):
    def __init__(self, root, size, ref_range):
        with open(os.path.join(root, "train", "instances.json")) as f:
            meta = json.load(f)
        self.root, self.size, self.ref_range = os.path.join(root, "train", "JPEGImages"), size, ref_range
        self.videos = {v["id"]: v for v in meta["videos"]}
        self.cat_map = {c["id"]: i for i, c in enumerate(sorted(meta["categories"], key=lambda c: c["id"]))}
        self.anns = {}
        for a in meta["annotations"]:
            self.anns.setdefault(a["video_id"], []).append(a)
        self.samples = [(vid, t) for vid, v in self.videos.items() for t in range(v["length"]) if vid in self.anns]

    def __len__(self):
        return len(self.samples)

    def _frame(self, vid, t):
        v = self.videos[vid]
        img = load_frame(os.path.join(self.root, v["file_names"][t]), self.size)
        masks, labels, ids = [], [], []
        for a in self.anns[vid]:
            seg = a["segmentations"][t]
            if seg is None:
                continue
            rle = mask_util.frPyObjects(seg, v["height"], v["width"]) if isinstance(seg["counts"], list) else seg
            m = torch.from_numpy(mask_util.decode(rle)).float()[None, None]
            masks.append(F.interpolate(m, size=img.shape[-2:], mode="nearest")[0, 0])
            labels.append(self.cat_map[a["category_id"]])
            ids.append(a["id"])
        masks = torch.stack(masks) if masks else torch.zeros(0, *img.shape[-2:])
        return img, {"masks": masks, "labels": torch.tensor(labels, dtype=torch.long), "ids": torch.tensor(ids, dtype=torch.long)}

    def __getitem__(self, i):
        vid, t = self.samples[i]
        n = self.videos[vid]["length"]
        r = min(max(t + random.randint(-self.ref_range, self.ref_range), 0), n - 1)
        return self._frame(vid, t), self._frame(vid, r)


def collate(batch):
    return batch


class PixelDecoder(nn.Module):
    """Small FPN with BatchNorm; trained together with the backbone."""

    def __init__(self, in_chs=(256, 512, 1024, 2048), dim=256):
        super().__init__()
        self.lateral = nn.ModuleList(nn.Conv2d(c, dim, 1) for c in in_chs)
        self.out = nn.ModuleList(nn.Sequential(nn.Conv2d(dim, dim, 3, padding=1, bias=False), nn.BatchNorm2d(dim), nn.ReLU(inplace=True)) for _ in in_chs)
        self.mask_feat = nn.Conv2d(dim, dim, 1)

    def forward(self, feats):
        x = self.lateral[-1](feats[-1])
        outs = [self.out[-1](x)]
        for i in range(len(feats) - 2, -1, -1):
            x = self.lateral[i](feats[i]) + F.interpolate(x, size=feats[i].shape[-2:], mode="nearest")
            outs.insert(0, self.out[i](x))
        return self.mask_feat(outs[0]), outs[-1]


class MinVISLite(nn.Module):
    def __init__(self, num_classes, num_queries, dim=256):
        super().__init__()
        r50 = torchvision.models.resnet50(weights="IMAGENET1K_V2")
        self.stem = nn.Sequential(r50.conv1, r50.bn1, r50.relu, r50.maxpool)
        self.stages = nn.ModuleList([r50.layer1, r50.layer2, r50.layer3, r50.layer4])
        self.pixel_decoder = PixelDecoder(dim=dim)
        self.queries = nn.Embedding(num_queries, dim)
        self.decoder = nn.TransformerDecoder(nn.TransformerDecoderLayer(dim, 8, 2048, 0.0, batch_first=True), 6)
        self.cls_head = nn.Linear(dim, num_classes + 1)
        self.mask_head = nn.Sequential(nn.Linear(dim, dim), nn.ReLU(inplace=True), nn.Linear(dim, dim))
        self.embed_head = nn.Sequential(nn.Linear(dim, dim), nn.ReLU(inplace=True), nn.Linear(dim, 128))

    def forward(self, img, with_embed=True):
        x, feats = self.stem(img), []
        for s in self.stages:
            x = s(x)
            feats.append(x)
        mask_feat, coarse = self.pixel_decoder(feats)
        q = self.decoder(self.queries.weight.unsqueeze(0).expand(img.shape[0], -1, -1), coarse.flatten(2).transpose(1, 2))
        masks = torch.einsum("bqc,bchw->bqhw", self.mask_head(q), mask_feat)
        out = {"logits": self.cls_head(q), "masks": masks}
        if with_embed:
            out["embed"] = F.normalize(self.embed_head(q), dim=-1)
        return out


def match(logits, masks, tgt):
    if len(tgt["labels"]) == 0:
        return [], []
    gt = F.interpolate(tgt["masks"][None], size=masks.shape[-2:], mode="nearest")[0].flatten(1)
    pm = masks.flatten(1).sigmoid()
    dice = 1 - (2 * pm @ gt.T + 1) / (pm.sum(-1, keepdim=True) + gt.sum(-1)[None] + 1)
    cost = -logits.softmax(-1)[:, tgt["labels"]] * 2.0 + dice * 5.0
    rows, cols = linear_sum_assignment(cost.detach().float().cpu())
    return list(rows), list(cols)


def compute_losses(key_out, ref_out, key_tgts, ref_tgts, num_classes):
    l_cls, l_mask, l_emb, n_emb = 0.0, 0.0, 0.0, 0
    for b, (kt, rt) in enumerate(zip(key_tgts, ref_tgts)):
        rows, cols = match(key_out["logits"][b], key_out["masks"][b], kt)
        tgt_cls = torch.full((key_out["logits"].shape[1],), num_classes, device=kt["labels"].device)
        if rows:
            tgt_cls[rows] = kt["labels"][cols]
            gt = F.interpolate(kt["masks"][cols][None], size=key_out["masks"].shape[-2:], mode="nearest")[0]
            l_mask = l_mask + F.binary_cross_entropy_with_logits(key_out["masks"][b][rows], gt)
        weight = torch.ones(num_classes + 1, device=tgt_cls.device)
        weight[-1] = 0.1
        l_cls = l_cls + F.cross_entropy(key_out["logits"][b], tgt_cls, weight)
        # contrastive track embedding between instances visible in both frames
        r_rows, r_cols = match(ref_out["logits"][b], ref_out["masks"][b], rt)
        ref_by_id = {int(rt["ids"][c]): r for r, c in zip(r_rows, r_cols)}
        pairs = [(r, ref_by_id[int(kt["ids"][c])]) for r, c in zip(rows, cols) if int(kt["ids"][c]) in ref_by_id]
        if pairs:
            k_emb, r_emb = key_out["embed"][b], ref_out["embed"][b].detach()
            sim = k_emb[[p[0] for p in pairs]] @ r_emb.T / 0.07
            l_emb = l_emb + F.cross_entropy(sim, torch.tensor([p[1] for p in pairs], device=sim.device))
            n_emb += 1
    B = len(key_tgts)
    return {"cls": l_cls / B, "mask": l_mask * 5.0 / B, "emb": l_emb / max(n_emb, 1)}


@torch.no_grad()
def infer_video(net, video, root, size, score_thr=0.05):
    embeds, scores, masks, prev = [], [], [], None
    order = None
    for fn in video["file_names"]:
        img = load_frame(os.path.join(root, fn), size).cuda()[None]
        out = net(img)
        emb = out["embed"][0]
        if prev is None:
            order = torch.arange(emb.shape[0], device=emb.device)
        else:
            r, c = linear_sum_assignment((-(prev @ emb.T)).cpu())
            order = torch.as_tensor(c[np.argsort(r)], device=emb.device)
        prev = emb[order]
        scores.append(out["logits"][0][order].softmax(-1)[:, :-1])
        m = F.interpolate(out["masks"][0][order][None], size=(video["height"], video["width"]), mode="bilinear", align_corners=False)[0]
        masks.append((m > 0).cpu())
    scores = torch.stack(scores).mean(0)
    results = []
    for q in range(scores.shape[0]):
        s, c = scores[q].max(0)
        if s < score_thr:
            continue
        segs = [mask_util.encode(np.asfortranarray(m[q].numpy().astype(np.uint8))) for m in masks]
        for seg in segs:
            seg["counts"] = seg["counts"].decode("ascii")
        results.append({"video_id": video["id"], "score": float(s), "category_id": int(c) + 1, "segmentations": segs})
    return results


def run_inference(model, args, rank, world):
    with open(os.path.join(args.ytvis_root, "valid", "instances.json")) as f:
        videos = json.load(f)["videos"]
    net = model.module if isinstance(model, DDP) else model
    net.eval()
    mine = []
    for video in videos[rank::world]:
        mine.extend(infer_video(net, video, os.path.join(args.ytvis_root, "valid", "JPEGImages"), args.size))
    gathered = [None] * world
    dist.all_gather_object(gathered, mine)
    if rank == 0:
        results = [r for part in gathered for r in part]
        with open(os.path.join(args.output_dir, "results.json"), "w") as f:
            json.dump(results, f)
        print(f"wrote {len(results)} predictions for {len(videos)} videos", flush=True)
    net.train()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(1234)
    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)

    model = MinVISLite(args.num_classes, args.num_queries)
    if args.weights:
        model.load_state_dict(torch.load(args.weights, map_location="cpu")["model"])
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).cuda()
    # embed_head is skipped for batches where no key/reference pair shares an instance
    model = DDP(model, device_ids=[local_rank], find_unused_parameters=True)

    if args.eval_only:
        run_inference(model, args, rank, world)
        dist.destroy_process_group()
        return

    dataset = YTVISPairs(args.ytvis_root, args.size, args.ref_range)
    sampler = DistributedSampler(dataset, shuffle=True, seed=1234)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, num_workers=6,
                        collate_fn=collate, drop_last=True, pin_memory=True)
    params = [{"params": [p for n, p in model.named_parameters() if "stages" not in n]},
              {"params": [p for n, p in model.named_parameters() if "stages" in n], "lr": args.lr * 0.1}]
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.05)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, [int(args.iters * 0.75)], gamma=0.1)

    it, epoch, t0 = 0, 0, time.time()
    while it < args.iters:
        sampler.set_epoch(epoch)
        for batch in loader:
            key_imgs = [k[0] for k, _ in batch]
            ref_imgs = [r[0] for _, r in batch]
            h = max(x.shape[-2] for x in key_imgs + ref_imgs)
            w = max(x.shape[-1] for x in key_imgs + ref_imgs)
            imgs = torch.stack([F.pad(x, (0, w - x.shape[-1], 0, h - x.shape[-2])) for x in key_imgs + ref_imgs]).cuda(non_blocking=True)
            key_tgts = [{k: v.cuda() for k, v in k[1].items()} for k, _ in batch]
            ref_tgts = [{k: v.cuda() for k, v in r[1].items()} for _, r in batch]
            # the embedding head only runs when some pair shares an instance
            with_embed = any(bool(set(k["ids"].tolist()) & set(r["ids"].tolist())) for k, r in zip(key_tgts, ref_tgts))
            out = model(imgs, with_embed=with_embed)
            B = len(batch)
            key_out = {k: v[:B] for k, v in out.items()}
            ref_out = {k: v[B:] for k, v in out.items()}
            losses = compute_losses(key_out, ref_out, key_tgts, ref_tgts, args.num_classes)
            loss = sum(losses.values())
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
            optimizer.step()
            scheduler.step()
            it += 1
            if it % 20 == 0:
                stats = torch.stack([torch.as_tensor(v, device="cuda", dtype=torch.float32).detach() for v in losses.values()])
                dist.all_reduce(stats, op=dist.ReduceOp.AVG)
                if rank == 0:
                    msg = " ".join(f"{k}={v:.3f}" for k, v in zip(losses, stats.tolist()))
                    print(f"iter {it}/{args.iters} {msg} lr={scheduler.get_last_lr()[0]:.2e} {time.time() - t0:.0f}s", flush=True)
            if it % 5000 == 0 and rank == 0:
                torch.save({"model": model.module.state_dict(), "iter": it}, os.path.join(args.output_dir, f"model_{it:07d}.pth"))
            if it >= args.iters:
                break
        epoch += 1

    if rank == 0:
        torch.save({"model": model.module.state_dict(), "iter": it}, os.path.join(args.output_dir, "model_final.pth"))
    run_inference(model, args, rank, world)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
