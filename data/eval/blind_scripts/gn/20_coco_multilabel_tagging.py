"""Multi-label image tagging on COCO-2017 (80 tags) with a ResNet-101, DDP.

* validation mAP / macro-F1 with torchmetrics every --eval-steps optimizer steps
* ReduceLROnPlateau on validation mAP, early stopping
* keep the --top-k best checkpoints, final test run with the best one
* gradient accumulation with DDP no_sync

    torchrun --nproc_per_node=8 20_coco_multilabel_tagging.py --coco /data/coco --accum 2
"""
import argparse
import contextlib
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torchvision
import torchvision.transforms as T
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from torchmetrics import MetricCollection
from torchmetrics.classification import MultilabelAveragePrecision, MultilabelF1Score


class CocoTags(Dataset):
    def __init__(self, img_dir, ann_file, transform):
        with open(ann_file) as f:
            ann = json.load(f)
        cat_ids = sorted(c["id"] for c in ann["categories"])
        self.cat_index = {c: i for i, c in enumerate(cat_ids)}
        self.files = {im["id"]: im["file_name"] for im in ann["images"]}
        self.ids = sorted(self.files)
        self.tags = {i: torch.zeros(len(cat_ids)) for i in self.ids}
        for a in ann["annotations"]:
            self.tags[a["image_id"]][self.cat_index[a["category_id"]]] = 1.0
        self.img_dir, self.transform = img_dir, transform

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        image_id = self.ids[i]
        img = Image.open(os.path.join(self.img_dir, self.files[image_id])).convert("RGB")
        return self.transform(img), self.tags[image_id]


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--coco", required=True)
    ap.add_argument("--out", default="runs/coco_tags_r101")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--accum", type=int, default=1)
    ap.add_argument("--lr", type=float, default=2e-4, help="tuned for 8 GPUs x 32 x accum 2")
    ap.add_argument("--max-steps", type=int, default=60000)
    ap.add_argument("--eval-steps", type=int, default=2000)
    ap.add_argument("--patience", type=int, default=6)
    ap.add_argument("--top-k", type=int, default=3)
    ap.add_argument("--val-images", type=int, default=5000, help="train2017 images held out for selection")
    return ap.parse_args()


def run_eval(model, loader, metrics, device):
    """Called on every rank; torchmetrics gathers the states of all ranks inside compute()."""
    model.eval()
    metrics.reset()
    with torch.no_grad():
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(x)
            metrics.update(torch.sigmoid(logits.float()), y.int())
    res = {k: v.item() for k, v in metrics.compute().items()}
    model.train()
    return res


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    norm = T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    train_tf = T.Compose([T.RandomResizedCrop(448, scale=(0.3, 1.0)), T.RandomHorizontalFlip(),
                          T.RandAugment(), T.ToTensor(), norm])
    eval_tf = T.Compose([T.Resize((448, 448)), T.ToTensor(), norm])
    ann = os.path.join(args.coco, "annotations")
    train_full = CocoTags(os.path.join(args.coco, "train2017"), os.path.join(ann, "instances_train2017.json"), train_tf)
    train_eval = CocoTags(os.path.join(args.coco, "train2017"), os.path.join(ann, "instances_train2017.json"), eval_tf)
    test_ds = CocoTags(os.path.join(args.coco, "val2017"), os.path.join(ann, "instances_val2017.json"), eval_tf)

    perm = torch.randperm(len(train_full), generator=torch.Generator().manual_seed(123)).tolist()
    train_ds = Subset(train_full, perm[args.val_images:])
    val_ds = Subset(train_eval, perm[: args.val_images])

    sampler = DistributedSampler(train_ds, shuffle=True, seed=0, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=8,
                              pin_memory=True, drop_last=True, persistent_workers=True)
    val_loader = DataLoader(Subset(val_ds, range(rank, len(val_ds), world)), batch_size=64, num_workers=8)
    test_loader = DataLoader(Subset(test_ds, range(rank, len(test_ds), world)), batch_size=64, num_workers=8)

    net = torchvision.models.resnet101(weights="IMAGENET1K_V2")
    net.fc = nn.Linear(net.fc.in_features, 80)
    net = nn.SyncBatchNorm.convert_sync_batchnorm(net).to(device)
    model = DDP(net, device_ids=[local_rank])
    optimizer = torch.optim.AdamW([
        {"params": [p for n, p in model.module.named_parameters() if not n.startswith("fc.")], "lr": args.lr},
        {"params": model.module.fc.parameters(), "lr": args.lr * 10},
    ], weight_decay=1e-4)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, mode="max", factor=0.3, patience=2)
    criterion = nn.BCEWithLogitsLoss()
    metrics = MetricCollection({
        "mAP": MultilabelAveragePrecision(num_labels=80, average="macro"),
        "f1": MultilabelF1Score(num_labels=80, average="macro", threshold=0.5),
    }).to(device)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    ranked = []  # [(mAP, step, path)], best first; bookkeeping identical on every rank
    best_map, bad_evals, step, micro, epoch = 0.0, 0, 0, 0, 0
    stop = False
    t0 = time.time()
    while not stop and step < args.max_steps:
        sampler.set_epoch(epoch)
        for x, y in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            micro += 1
            boundary = micro % args.accum == 0
            with model.no_sync() if not boundary else contextlib.nullcontext():
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = criterion(model(x).float(), y) / args.accum
                loss.backward()
            if not boundary:
                continue
            nn.utils.clip_grad_norm_(model.parameters(), 10.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            if rank == 0 and step % 100 == 0:
                print(f"step {step} loss {loss.item() * args.accum:.4f} {time.time() - t0:.0f}s", flush=True)

            if step % args.eval_steps == 0:
                res = run_eval(model.module, val_loader, metrics, device)
                plateau.step(res["mAP"])
                path = os.path.join(args.out, f"step{step:06d}_map{res['mAP']:.4f}.pt")
                ranked.append((res["mAP"], step, path))
                ranked.sort(reverse=True)
                dropped = ranked[args.top_k:]
                ranked = ranked[: args.top_k]
                if rank == 0:
                    print(f"[eval] step {step} mAP {res['mAP']:.4f} F1 {res['f1']:.4f} "
                          f"lr {optimizer.param_groups[0]['lr']:.2e}", flush=True)
                    if any(p == path for _, _, p in ranked):
                        torch.save({"step": step, "model": model.module.state_dict(), "metrics": res}, path)
                    for _, _, p in dropped:
                        if os.path.exists(p):
                            os.remove(p)
                if res["mAP"] > best_map + 1e-4:
                    best_map, bad_evals = res["mAP"], 0
                else:
                    bad_evals += 1
                if bad_evals >= args.patience:
                    stop = True
                    break
            if step >= args.max_steps:
                break
        epoch += 1

    dist.barrier()  # rank 0 has finished writing
    best_step, best_path = ranked[0][1], ranked[0][2]
    state = torch.load(best_path, map_location=device)
    model.module.load_state_dict(state["model"])
    test = run_eval(model.module, test_loader, metrics, device)
    if rank == 0:
        print(f"[test] best step {best_step}: val mAP {ranked[0][0]:.4f}, test mAP {test['mAP']:.4f} "
              f"F1 {test['f1']:.4f}")
        with open(os.path.join(args.out, "test_metrics.json"), "w") as f:
            json.dump({"best_step": best_step, **test}, f, indent=2)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
