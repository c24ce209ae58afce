"""Weighted k-NN evaluation of a self-supervised ViT (DINO / iBOT teacher checkpoint) on ImageNet.

Features of the full train and val sets are extracted in parallel on all GPUs,
gathered on every rank, and the k-NN vote is done in chunks on rank 0.
"""
import argparse
import os
import time

import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torchvision import datasets
from torchvision import transforms as pth_transforms


def parse_args():
    parser = argparse.ArgumentParser("k-NN evaluation")
    parser.add_argument("--batch_size_per_gpu", default=128, type=int)
    parser.add_argument("--nb_knn", default=[10, 20, 100, 200], nargs="+", type=int)
    parser.add_argument("--temperature", default=0.07, type=float)
    parser.add_argument("--pretrained_weights", default="", type=str)
    parser.add_argument("--checkpoint_key", default="teacher", type=str)
    parser.add_argument("--arch", default="vit_small_patch16_224", type=str)
    parser.add_argument("--use_cuda", default=True, type=bool)
    parser.add_argument("--dump_features", default=None, help="folder where to save the features")
    parser.add_argument("--num_workers", default=10, type=int)
    parser.add_argument("--data_path", default="/path/to/imagenet/", type=str)
    return parser.parse_args()


class ReturnIndexDataset(datasets.ImageFolder):
    def __getitem__(self, idx):
        img, lab = super().__getitem__(idx)
        return img, idx


def load_pretrained_weights(model, path, key):
    state_dict = torch.load(path, map_location="cpu")
    if key in state_dict:
        state_dict = state_dict[key]
    state_dict = {k.replace("module.", ""): v for k, v in state_dict.items()}
    state_dict = {k.replace("backbone.", ""): v for k, v in state_dict.items()}
    msg = model.load_state_dict(state_dict, strict=False)
    print(f"Pretrained weights found at {path} and loaded with msg: {msg}")


@torch.no_grad()
def extract_features(model, dataset, args, rank, world_size):
    # round-robin split of the dataset so that every image is seen exactly once
    shard = torch.utils.data.Subset(dataset, list(range(rank, len(dataset), world_size)))
    loader = torch.utils.data.DataLoader(shard, batch_size=args.batch_size_per_gpu, num_workers=args.num_workers,
                                         pin_memory=True, drop_last=False, shuffle=False)
    local_feats, local_index = [], []
    for i, (samples, index) in enumerate(loader):
        samples = samples.cuda(non_blocking=True)
        feats = model(samples).clone()
        local_feats.append(feats)
        local_index.append(index.cuda(non_blocking=True))
        if rank == 0 and i % 50 == 0:
            print(f"  [{i}/{len(loader)}]", flush=True)
    local_feats = torch.cat(local_feats)
    local_index = torch.cat(local_index)

    gathered_feats = [torch.zeros_like(local_feats) for _ in range(world_size)]
    gathered_index = [torch.zeros_like(local_index) for _ in range(world_size)]
    dist.all_gather(gathered_feats, local_feats)
    dist.all_gather(gathered_index, local_index)

    features = torch.zeros(len(dataset), local_feats.shape[-1], device=local_feats.device)
    features.index_copy_(0, torch.cat(gathered_index), torch.cat(gathered_feats))
    return features


@torch.no_grad()
def knn_classifier(train_features, train_labels, test_features, test_labels, k, T, num_classes=1000):
    top1, top5, total = 0.0, 0.0, 0
    train_features = train_features.t()
    num_test_images, num_chunks = test_labels.shape[0], 100
    imgs_per_chunk = num_test_images // num_chunks
    retrieval_one_hot = torch.zeros(k, num_classes).to(train_features.device)
    for idx in range(0, num_test_images, imgs_per_chunk):
        features = test_features[idx: min((idx + imgs_per_chunk), num_test_images), :]
        targets = test_labels[idx: min((idx + imgs_per_chunk), num_test_images)]
        batch_size = targets.shape[0]

        similarity = torch.mm(features, train_features)
        distances, indices = similarity.topk(k, largest=True, sorted=True)
        candidates = train_labels.view(1, -1).expand(batch_size, -1)
        retrieved_neighbors = torch.gather(candidates, 1, indices)

        retrieval_one_hot.resize_(batch_size * k, num_classes).zero_()
        retrieval_one_hot.scatter_(1, retrieved_neighbors.view(-1, 1), 1)
        distances_transform = distances.clone().div_(T).exp_()
        probs = torch.sum(torch.mul(retrieval_one_hot.view(batch_size, -1, num_classes),
                                    distances_transform.view(batch_size, -1, 1)), 1)
        _, predictions = probs.sort(1, True)

        correct = predictions.eq(targets.data.view(-1, 1))
        top1 = top1 + correct.narrow(1, 0, 1).sum().item()
        top5 = top5 + correct.narrow(1, 0, min(5, k)).sum().item()
        total += targets.size(0)
    return top1 * 100.0 / total, top5 * 100.0 / total


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()

    transform = pth_transforms.Compose([
        pth_transforms.Resize(256, interpolation=3),
        pth_transforms.CenterCrop(224),
        pth_transforms.ToTensor(),
        pth_transforms.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)),
    ])
    dataset_train = ReturnIndexDataset(os.path.join(args.data_path, "train"), transform=transform)
    dataset_val = ReturnIndexDataset(os.path.join(args.data_path, "val"), transform=transform)
    if rank == 0:
        print(f"Data loaded with {len(dataset_train)} train and {len(dataset_val)} val imgs.")

    model = timm.create_model(args.arch, num_classes=0)
    load_pretrained_weights(model, args.pretrained_weights, args.checkpoint_key)
    model.cuda()
    model.eval()

    t0 = time.time()
    if rank == 0:
        print("Extracting features for train set...")
    train_features = extract_features(model, dataset_train, args, rank, world_size)
    if rank == 0:
        print("Extracting features for val set...")
    test_features = extract_features(model, dataset_val, args, rank, world_size)
    if rank == 0:
        print(f"Feature extraction took {time.time() - t0:.0f}s")

    if rank == 0:
        train_features = nn.functional.normalize(train_features, dim=1, p=2)
        test_features = nn.functional.normalize(test_features, dim=1, p=2)
        train_labels = torch.tensor([s[-1] for s in dataset_train.samples]).long().cuda()
        test_labels = torch.tensor([s[-1] for s in dataset_val.samples]).long().cuda()

        if args.dump_features:
            os.makedirs(args.dump_features, exist_ok=True)
            torch.save(train_features.cpu(), os.path.join(args.dump_features, "trainfeat.pth"))
            torch.save(test_features.cpu(), os.path.join(args.dump_features, "testfeat.pth"))
            torch.save(train_labels.cpu(), os.path.join(args.dump_features, "trainlabels.pth"))
            torch.save(test_labels.cpu(), os.path.join(args.dump_features, "testlabels.pth"))

        print("Features are ready!\nStart the k-NN classification.")
        for k in args.nb_knn:
            top1, top5 = knn_classifier(train_features, train_labels, test_features, test_labels, k, args.temperature)
            print(f"{k}-NN classifier result: Top1: {top1}, Top5: {top5}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
