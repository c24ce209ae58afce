"""
Image-text retrieval fine-tuning (ALBEF-style ITC) on Flickr30k / COCO Karpathy splits.
"""
import argparse
import datetime
import json
import os
import random
import time
from pathlib import Path

import numpy as np
import ruamel.yaml as yaml
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.distributed.nn.functional import all_gather as all_gather_with_grad
from torch.utils.data import DataLoader, Dataset
from torchvision import transforms
from transformers import BertModel, BertTokenizerFast


def is_dist_avail_and_initialized():
    return dist.is_available() and dist.is_initialized()


def get_rank():
    return dist.get_rank() if is_dist_avail_and_initialized() else 0


def get_world_size():
    return dist.get_world_size() if is_dist_avail_and_initialized() else 1


def is_main_process():
    return get_rank() == 0


def init_distributed_mode(args):
    if 'RANK' in os.environ and 'WORLD_SIZE' in os.environ:
        args.rank = int(os.environ["RANK"])
        args.world_size = int(os.environ['WORLD_SIZE'])
        args.gpu = int(os.environ['LOCAL_RANK'])
    else:
        print('Not using distributed mode')
        args.distributed = False
        return
    args.distributed = True
    torch.cuda.set_device(args.gpu)
    dist.init_process_group(backend='nccl', init_method='env://', world_size=args.world_size, rank=args.rank)
    dist.barrier()


class RetrievalDataset(Dataset):
    """Pre-tokenizes every caption once and keeps the token ids in a cache file next to the annotations."""

    def __init__(self, ann_file, image_root, tokenizer, transform, max_words=30, train=True):
        self.image_root, self.transform, self.train = image_root, transform, train
        cache_file = os.path.splitext(ann_file)[0] + '_tok{}.pt'.format(max_words)
        if os.path.exists(cache_file):
            cache = torch.load(cache_file, map_location='cpu')
        else:
            ann = json.load(open(ann_file, 'r'))
            images, captions, txt2img = [], [], []
            for img_id, a in enumerate(ann):
                images.append(a['image'])
                caps = a['caption'] if isinstance(a['caption'], list) else [a['caption']]
                for c in caps:
                    captions.append(c.lower().strip())
                    txt2img.append(img_id)
            tok = tokenizer(captions, padding='max_length', truncation=True, max_length=max_words, return_tensors='pt')
            cache = {'images': images, 'input_ids': tok.input_ids, 'attention_mask': tok.attention_mask,
                     'txt2img': torch.tensor(txt2img)}
            torch.save(cache, cache_file)
        self.images = cache['images']
        self.input_ids, self.attention_mask = cache['input_ids'], cache['attention_mask']
        self.txt2img = cache['txt2img']

    def __len__(self):
        return len(self.txt2img) if self.train else len(self.images)

    def load_image(self, img_id):
        return self.transform(Image.open(os.path.join(self.image_root, self.images[img_id])).convert('RGB'))

    def __getitem__(self, index):
        if self.train:
            return self.load_image(self.txt2img[index].item()), self.input_ids[index], self.attention_mask[index], \
                self.txt2img[index]
        return self.load_image(index), index


class ALBEFRetrieval(nn.Module):
    def __init__(self, text_encoder='bert-base-uncased', vit='vit_base_patch16_224', embed_dim=256, temp=0.07):
        super().__init__()
        self.visual_encoder = timm.create_model(vit, pretrained=True, num_classes=0, drop_path_rate=0.1)
        self.text_encoder = BertModel.from_pretrained(text_encoder, add_pooling_layer=False)
        self.vision_proj = nn.Linear(self.visual_encoder.num_features, embed_dim)
        self.text_proj = nn.Linear(self.text_encoder.config.hidden_size, embed_dim)
        self.temp = nn.Parameter(torch.ones([]) * temp)

    def encode_image(self, image):
        return F.normalize(self.vision_proj(self.visual_encoder(image)), dim=-1)

    def encode_text(self, input_ids, attention_mask):
        out = self.text_encoder(input_ids, attention_mask=attention_mask, return_dict=True)
        return F.normalize(self.text_proj(out.last_hidden_state[:, 0, :]), dim=-1)

    def forward(self, image, input_ids, attention_mask, idx):
        with torch.no_grad():
            self.temp.clamp_(0.001, 0.5)
        image_feat = self.encode_image(image)
        text_feat = self.encode_text(input_ids, attention_mask)
        if is_dist_avail_and_initialized():
            image_feat_all = torch.cat(all_gather_with_grad(image_feat), dim=0)
            text_feat_all = torch.cat(all_gather_with_grad(text_feat), dim=0)
            idx_all = torch.cat(all_gather_with_grad(idx.float()), dim=0).long()
        else:
            image_feat_all, text_feat_all, idx_all = image_feat, text_feat, idx
        # captions of the same image are all positives
        pos = torch.eq(idx.view(-1, 1), idx_all.view(1, -1)).float()
        sim_targets = pos / pos.sum(1, keepdim=True)
        sim_i2t = image_feat @ text_feat_all.t() / self.temp
        sim_t2i = text_feat @ image_feat_all.t() / self.temp
        loss_i2t = -torch.sum(F.log_softmax(sim_i2t, dim=1) * sim_targets, dim=1).mean()
        loss_t2i = -torch.sum(F.log_softmax(sim_t2i, dim=1) * sim_targets, dim=1).mean()
        return (loss_i2t + loss_t2i) / 2


def cosine_lr_schedule(optimizer, epoch, max_epoch, init_lr, min_lr):
    lr = (init_lr - min_lr) * 0.5 * (1. + np.cos(np.pi * epoch / max_epoch)) + min_lr
    for param_group in optimizer.param_groups:
        param_group['lr'] = lr


def train(model, data_loader, optimizer, epoch, device, config):
    model.train()
    total, n = 0.0, 0
    start = time.time()
    for i, (image, input_ids, attention_mask, idx) in enumerate(data_loader):
        image = image.to(device, non_blocking=True)
        input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
        idx = idx.to(device, non_blocking=True)
        if epoch == 0 and i < config['warmup_steps']:
            for g in optimizer.param_groups:
                g['lr'] = config['warmup_lr'] + (config['init_lr'] - config['warmup_lr']) * i / config['warmup_steps']
        loss = model(image, input_ids, attention_mask, idx)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        total += loss.item()
        n += 1
        if i % 50 == 0:
            print('Train Epoch: [{}] [{}/{}] loss_ita: {:.4f} lr: {:.6f} ({:.1f}s)'.format(
                epoch, i, len(data_loader), loss.item(), optimizer.param_groups[0]['lr'], time.time() - start))
    stats = torch.tensor([total, n], dtype=torch.float64, device=device)
    if is_dist_avail_and_initialized():
        dist.all_reduce(stats)
    return {'loss_ita': (stats[0] / stats[1]).item()}


@torch.no_grad()
def evaluation(model, data_loader, dataset, device):
    model.eval()
    text_embeds = []
    for i in range(0, len(dataset.input_ids), 256):
        text_embeds.append(model.encode_text(dataset.input_ids[i:i + 256].to(device),
                                             dataset.attention_mask[i:i + 256].to(device)))
    text_embeds = torch.cat(text_embeds, dim=0)
    image_embeds = torch.cat([model.encode_image(image.to(device)) for image, _ in data_loader], dim=0)
    return (image_embeds @ text_embeds.t()).cpu().numpy()


@torch.no_grad()
def itm_eval(scores_i2t, txt2img):
    img2txt = [np.where(txt2img == i)[0] for i in range(scores_i2t.shape[0])]
    ranks = np.zeros(scores_i2t.shape[0])
    for index, score in enumerate(scores_i2t):
        inds = np.argsort(score)[::-1]
        ranks[index] = min(np.where(inds == j)[0][0] for j in img2txt[index])
    tr = [100.0 * np.mean(ranks < k) for k in (1, 5, 10)]
    ranks = np.zeros(scores_i2t.shape[1])
    for index, score in enumerate(scores_i2t.T):
        inds = np.argsort(score)[::-1]
        ranks[index] = np.where(inds == txt2img[index])[0][0]
    ir = [100.0 * np.mean(ranks < k) for k in (1, 5, 10)]
    return {'txt_r1': tr[0], 'txt_r5': tr[1], 'txt_r10': tr[2], 'img_r1': ir[0], 'img_r5': ir[1], 'img_r10': ir[2],
            'r_mean': (sum(tr) + sum(ir)) / 6}


def main(args, config):
    init_distributed_mode(args)
    device = torch.device(args.device)
    seed = args.seed + get_rank()
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)

    normalize = transforms.Normalize((0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711))
    train_transform = transforms.Compose([
        transforms.RandomResizedCrop(config['image_res'], scale=(0.5, 1.0), interpolation=Image.BICUBIC),
        transforms.RandomHorizontalFlip(), transforms.ToTensor(), normalize])
    test_transform = transforms.Compose([
        transforms.Resize((config['image_res'], config['image_res']), interpolation=Image.BICUBIC),
        transforms.ToTensor(), normalize])

    tokenizer = BertTokenizerFast.from_pretrained(args.text_encoder)
    train_dataset = RetrievalDataset(config['train_file'], config['image_root'], tokenizer, train_transform, train=True)
    test_dataset = RetrievalDataset(config['test_file'], config['image_root'], tokenizer, test_transform, train=False)

    if args.distributed:
        train_sampler = torch.utils.data.DistributedSampler(train_dataset, num_replicas=get_world_size(),
                                                            rank=get_rank(), shuffle=True)
    else:
        train_sampler = torch.utils.data.RandomSampler(train_dataset)
    train_loader = DataLoader(train_dataset, batch_size=config['batch_size_train'], sampler=train_sampler,
                              num_workers=4, pin_memory=True, drop_last=True)
    test_loader = DataLoader(test_dataset, batch_size=config['batch_size_test'], shuffle=False, num_workers=4)

    model = ALBEFRetrieval(text_encoder=args.text_encoder, embed_dim=config['embed_dim']).to(device)
    if args.checkpoint:
        checkpoint = torch.load(args.checkpoint, map_location='cpu')
        msg = model.load_state_dict(checkpoint['model'], strict=False)
        print('load checkpoint from %s' % args.checkpoint, msg)
    model_without_ddp = model
    if args.distributed:
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[args.gpu])
        model_without_ddp = model.module

    optimizer = torch.optim.AdamW(model.parameters(), lr=config['init_lr'], weight_decay=config['weight_decay'])
    best, best_epoch = 0, 0
    for epoch in range(config['max_epoch']):
        if args.distributed:
            train_loader.sampler.set_epoch(epoch)
        if epoch > 0:
            cosine_lr_schedule(optimizer, epoch, config['max_epoch'], config['init_lr'], config['min_lr'])
        train_stats = train(model, train_loader, optimizer, epoch, device, config)

        score_i2t = evaluation(model_without_ddp, test_loader, test_dataset, device)
        if is_main_process():
            test_result = itm_eval(score_i2t, test_dataset.txt2img.numpy())
            print(test_result)
            log_stats = {**{f'train_{k}': v for k, v in train_stats.items()},
                         **{f'test_{k}': v for k, v in test_result.items()}, 'epoch': epoch}
            with open(os.path.join(args.output_dir, "log.txt"), "a") as f:
                f.write(json.dumps(log_stats) + "\n")
            if test_result['r_mean'] > best:
                torch.save({'model': model_without_ddp.state_dict(), 'optimizer': optimizer.state_dict(),
                            'config': config, 'epoch': epoch}, os.path.join(args.output_dir, 'checkpoint_best.pth'))
                best, best_epoch = test_result['r_mean'], epoch
        if args.distributed:
            dist.barrier()

    if is_main_process():
        print('best epoch: %d, r_mean %.2f' % (best_epoch, best))
    if args.distributed:
        dist.destroy_process_group()


if __name__ == '__main__':
    parser = argparse.ArgumentParser()
    parser.add_argument('--config', default='./configs/Retrieval_flickr.yaml')
    parser.add_argument('--output_dir', default='output/Retrieval_flickr')
    parser.add_argument('--checkpoint', default='')
    parser.add_argument('--text_encoder', default='bert-base-uncased')
    parser.add_argument('--device', default='cuda')
    parser.add_argument('--seed', default=42, type=int)
    args = parser.parse_args()
    config = yaml.load(open(args.config, 'r'), Loader=yaml.Loader)
    Path(args.output_dir).mkdir(parents=True, exist_ok=True)
    start_time = time.time()
    main(args, config)
    print('Training time {}'.format(str(datetime.timedelta(seconds=int(time.time() - start_time)))))
