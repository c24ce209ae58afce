# Fine-tune the SAM mask decoder with box prompts on a 2D medical segmentation set (MedSAM-style preprocessing).
# Image encoder and prompt encoder are frozen; images are pre-resized to 1024x1024 and stored as .npy.
import argparse
import glob
import json
import os
import random
import time
from datetime import datetime

import monai
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import wandb
from segment_anything import sam_model_registry
from torch.utils.data import DataLoader, Dataset, Sampler
from torch.utils.data.distributed import DistributedSampler


def get_rank():
    return dist.get_rank() if dist.is_initialized() else 0


def get_world_size():
    return dist.get_world_size() if dist.is_initialized() else 1


class NpyDataset(Dataset):
    def __init__(self, data_root, bbox_shift=20, train=True):
        self.gt_files = sorted(glob.glob(os.path.join(data_root, "gts", "*.npy")))
        self.img_root = os.path.join(data_root, "imgs")
        self.bbox_shift, self.train = bbox_shift, train

    def __len__(self):
        return len(self.gt_files)

    def __getitem__(self, index):
        name = os.path.basename(self.gt_files[index])
        img = np.load(os.path.join(self.img_root, name), allow_pickle=True)  # (1024, 1024, 3), [0, 1]
        gt = np.load(self.gt_files[index], allow_pickle=True)  # (256, 256) label map
        labels = np.unique(gt)[1:]
        label = random.choice(labels.tolist()) if self.train else labels[0]
        gt2d = np.uint8(gt == label)
        y, x = np.where(gt2d > 0)
        x_min, x_max, y_min, y_max = np.min(x), np.max(x), np.min(y), np.max(y)
        if self.train:
            H, W = gt2d.shape
            x_min = max(0, x_min - random.randint(0, self.bbox_shift))
            x_max = min(W, x_max + random.randint(0, self.bbox_shift))
            y_min = max(0, y_min - random.randint(0, self.bbox_shift))
            y_max = min(H, y_max + random.randint(0, self.bbox_shift))
        bbox = np.array([x_min, y_min, x_max, y_max]) * 4  # 256 -> 1024 box coordinates
        return (torch.tensor(img).float().permute(2, 0, 1), torch.tensor(gt2d[None]).long(),
                torch.tensor(bbox).float(), name)


class StridedSampler(Sampler):
    def __init__(self, dataset):
        self.indices = list(range(get_rank(), len(dataset), get_world_size()))

    def __iter__(self):
        return iter(self.indices)

    def __len__(self):
        return len(self.indices)


class MedSAM(nn.Module):
    def __init__(self, sam):
        super().__init__()
        self.image_encoder, self.mask_decoder, self.prompt_encoder = sam.image_encoder, sam.mask_decoder, sam.prompt_encoder
        for p in list(self.image_encoder.parameters()) + list(self.prompt_encoder.parameters()):
            p.requires_grad = False

    def forward(self, image, box):
        with torch.no_grad():
            image_embedding = self.image_encoder(image)
            sparse_embeddings, dense_embeddings = self.prompt_encoder(points=None, boxes=box[:, None, :], masks=None)
        low_res_masks, iou_pred = self.mask_decoder(
            image_embeddings=image_embedding, image_pe=self.prompt_encoder.get_dense_pe(),
            sparse_prompt_embeddings=sparse_embeddings, dense_prompt_embeddings=dense_embeddings, multimask_output=False)
        return low_res_masks, iou_pred


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    dice_sum = torch.zeros(2, device=device, dtype=torch.float64)
    for image, gt, box, _ in loader:
        image, gt, box = image.to(device), gt.to(device), box.to(device)
        logits, _ = model(image, box)
        pred = (logits > 0).long()
        inter = (pred * gt).sum(dim=(1, 2, 3)).double()
        denom = (pred.sum(dim=(1, 2, 3)) + gt.sum(dim=(1, 2, 3))).double()
        dice_sum += torch.stack([(2 * inter / denom.clamp(min=1)).sum(), torch.tensor(float(len(gt)), device=device,
                                                                                     dtype=torch.float64)])
    dist.all_reduce(dice_sum)
    model.train()
    return (dice_sum[0] / dice_sum[1]).item()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tr_npy_path", default="data/npy/CT_Abd/train")
    parser.add_argument("--val_npy_path", default="data/npy/CT_Abd/val")
    parser.add_argument("--model_type", default="vit_b")
    parser.add_argument("--checkpoint", default="work_dir/SAM/sam_vit_b_01ec64.pth")
    parser.add_argument("--work_dir", default="./work_dir")
    parser.add_argument("--task_name", default="MedSAM-ViT-B")
    parser.add_argument("--num_epochs", type=int, default=100)
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--num_workers", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--weight_decay", type=float, default=0.01)
    parser.add_argument("--use_amp", action="store_true")
    parser.add_argument("--seed", type=int, default=2023)
    args = parser.parse_args()

    rank, world_size, local_rank = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl", init_method="env://", rank=rank, world_size=world_size)
    device = torch.device(f"cuda:{local_rank}")
    torch.manual_seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    random.seed(args.seed + rank)

    run_id = datetime.now().strftime("%Y%m%d-%H%M")
    model_save_path = os.path.join(args.work_dir, args.task_name + "-" + run_id)
    if rank == 0:
        os.makedirs(model_save_path, exist_ok=True)
    wandb.init(project=args.task_name, name=run_id, config=vars(args),
               settings=wandb.Settings(start_method="fork"))

    sam = sam_model_registry[args.model_type](checkpoint=args.checkpoint)
    model = MedSAM(sam).to(device)
    model = nn.parallel.DistributedDataParallel(model, device_ids=[local_rank], output_device=local_rank,
                                                gradient_as_bucket_view=True)
    model_without_ddp = model.module
    optimizer = torch.optim.AdamW(model_without_ddp.mask_decoder.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.num_epochs, eta_min=1e-6)
    seg_loss = monai.losses.DiceLoss(sigmoid=True, squared_pred=True, reduction="mean")
    ce_loss = nn.BCEWithLogitsLoss(reduction="mean")
    scaler = torch.cuda.amp.GradScaler(enabled=args.use_amp)

    train_dataset, val_dataset = NpyDataset(args.tr_npy_path), NpyDataset(args.val_npy_path, train=False)
    train_sampler = DistributedSampler(train_dataset, shuffle=True)
    train_loader = DataLoader(train_dataset, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.num_workers, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_dataset, batch_size=args.batch_size, sampler=StridedSampler(val_dataset),
                            num_workers=args.num_workers)
    print(f"rank {rank}: {len(train_dataset)} training / {len(val_dataset)} validation slices")

    best_dice, global_step = 0.0, 0
    for epoch in range(args.num_epochs):
        train_sampler.set_epoch(epoch)
        epoch_loss, t0 = 0.0, time.time()
        for step, (image, gt2d, boxes, _) in enumerate(train_loader):
            image, gt2d, boxes = image.to(device), gt2d.to(device), boxes.to(device)
            with torch.autocast(device_type="cuda", dtype=torch.float16, enabled=args.use_amp):
                mask_pred, iou_pred = model(image, boxes)
                with torch.no_grad():
                    hard = (mask_pred > 0).float()
                    inter = (hard * gt2d).sum(dim=(2, 3))
                    iou_target = inter / ((hard + gt2d).clamp(max=1).sum(dim=(2, 3)) + 1e-6)
                loss = seg_loss(mask_pred, gt2d) + ce_loss(mask_pred, gt2d.float()) + F.mse_loss(iou_pred, iou_target)
            optimizer.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            epoch_loss += loss.item()
            global_step += 1
            if step % 20 == 0:
                wandb.log({"train/loss": loss.item(), "train/lr": optimizer.param_groups[0]["lr"]}, step=global_step)
        scheduler.step()

        epoch_loss /= max(step + 1, 1)
        val_dice = evaluate(model_without_ddp, val_loader, device)
        wandb.log({"epoch": epoch, "train/epoch_loss": epoch_loss, "val/dice": val_dice}, step=global_step)
        print(f"{datetime.now()} rank {rank} epoch {epoch} loss {epoch_loss:.4f} val dice {val_dice:.4f} "
              f"({time.time() - t0:.0f}s)")
        if rank == 0:
            checkpoint = {"model": model_without_ddp.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch}
            torch.save(checkpoint, os.path.join(model_save_path, "medsam_model_latest.pth"))
            if val_dice > best_dice:
                best_dice = val_dice
                torch.save(checkpoint, os.path.join(model_save_path, "medsam_model_best.pth"))
            with open(os.path.join(model_save_path, "log.jsonl"), "a") as f:
                f.write(json.dumps({"epoch": epoch, "loss": epoch_loss, "val_dice": val_dice}) + "\n")
        dist.barrier()

    wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
