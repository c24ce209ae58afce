'''
Image captioning fine-tuning on COCO Karpathy split (BLIP-style ViT encoder + BERT decoder with cross-attention).
'''
import argparse
import datetime
import json
import os
import random
import re
import time
from pathlib import Path

import numpy as np
import timm
import torch
import torch.distributed as dist
from PIL import Image
from pycocoevalcap.eval import COCOEvalCap
from pycocotools.coco import COCO
from torch import nn
from torch.utils.data import DataLoader, Dataset
from torchvision import transforms
from transformers import BertConfig, BertLMHeadModel, BertTokenizer


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
        args.rank, args.world_size = int(os.environ["RANK"]), int(os.environ['WORLD_SIZE'])
        args.gpu = int(os.environ['LOCAL_RANK'])
    else:
        print('Not using distributed mode')
        args.distributed = False
        return
    args.distributed = True
    torch.cuda.set_device(args.gpu)
    dist.init_process_group(backend='nccl', init_method=args.dist_url, world_size=args.world_size, rank=args.rank)
    dist.barrier()


def create_sampler(datasets, shuffles, num_tasks, global_rank):
    return [torch.utils.data.DistributedSampler(d, num_replicas=num_tasks, rank=global_rank, shuffle=s)
            for d, s in zip(datasets, shuffles)]


def pre_caption(caption, max_words=50):
    caption = re.sub(r"([.!\"()*#:;~])", ' ', caption.lower())
    caption = re.sub(r"\s{2,}", ' ', caption).rstrip('\n').strip(' ')
    return ' '.join(caption.split(' ')[:max_words])


class CocoCaption(Dataset):
    def __init__(self, ann_file, image_root, transform, train=True, prompt='a picture of '):
        self.annotation = json.load(open(ann_file, 'r'))
        self.image_root, self.transform, self.train, self.prompt = image_root, transform, train, prompt
        if not train:  # one entry per image for generation
            seen, uniq = set(), []
            for ann in self.annotation:
                if ann['image'] not in seen:
                    seen.add(ann['image'])
                    uniq.append(ann)
            self.annotation = uniq

    def __len__(self):
        return len(self.annotation)

    def __getitem__(self, index):
        ann = self.annotation[index]
        image = self.transform(Image.open(os.path.join(self.image_root, ann['image'])).convert('RGB'))
        if self.train:
            return image, self.prompt + pre_caption(ann['caption'], 30)
        img_id = int(ann['image'].split('/')[-1].strip('.jpg').split('_')[-1])
        return image, img_id


class BLIPDecoder(nn.Module):
    def __init__(self, vit='vit_base_patch16_384', prompt='a picture of '):
        super().__init__()
        self.visual_encoder = timm.create_model(vit, pretrained=True, num_classes=0, drop_path_rate=0.1)
        self.tokenizer = BertTokenizer.from_pretrained('bert-base-uncased')
        self.tokenizer.add_special_tokens({'bos_token': '[DEC]'})
        config = BertConfig.from_pretrained('bert-base-uncased', is_decoder=True, add_cross_attention=True)
        self.text_decoder = BertLMHeadModel.from_pretrained('bert-base-uncased', config=config)
        self.text_decoder.resize_token_embeddings(len(self.tokenizer))
        self.prompt = prompt
        self.prompt_length = len(self.tokenizer(self.prompt).input_ids) - 1

    def forward(self, image, caption):
        image_embeds = self.visual_encoder.forward_features(image)
        image_atts = torch.ones(image_embeds.size()[:-1], dtype=torch.long, device=image.device)
        text = self.tokenizer(caption, padding='longest', truncation=True, max_length=40, return_tensors="pt").to(image.device)
        text.input_ids[:, 0] = self.tokenizer.bos_token_id
        decoder_targets = text.input_ids.masked_fill(text.input_ids == self.tokenizer.pad_token_id, -100)
        decoder_targets[:, :self.prompt_length] = -100
        out = self.text_decoder(text.input_ids, attention_mask=text.attention_mask, encoder_hidden_states=image_embeds,
                                encoder_attention_mask=image_atts, labels=decoder_targets, return_dict=True)
        return out.loss

    @torch.no_grad()
    def generate(self, image, max_length=30, min_length=5):
        image_embeds = self.visual_encoder.forward_features(image)
        image_atts = torch.ones(image_embeds.size()[:-1], dtype=torch.long, device=image.device)
        prompt = self.tokenizer([self.prompt] * image.size(0), return_tensors="pt").to(image.device)
        input_ids = prompt.input_ids[:, :-1]
        input_ids[:, 0] = self.tokenizer.bos_token_id
        finished = torch.zeros(image.size(0), dtype=torch.bool, device=image.device)
        for step in range(max_length):
            logits = self.text_decoder(input_ids, encoder_hidden_states=image_embeds, encoder_attention_mask=image_atts,
                                       return_dict=True).logits[:, -1, :]
            if step < min_length:
                logits[:, self.tokenizer.sep_token_id] = -float('inf')
            next_tok = logits.argmax(-1).masked_fill(finished, self.tokenizer.pad_token_id)
            input_ids = torch.cat([input_ids, next_tok[:, None]], dim=1)
            finished |= next_tok == self.tokenizer.sep_token_id
            if finished.all():
                break
        captions = self.tokenizer.batch_decode(input_ids, skip_special_tokens=True)
        return [c[len(self.prompt):].strip() for c in captions]


def train(model, data_loader, optimizer, epoch, device):
    model.train()
    loss_sum, t0 = 0.0, time.time()
    for i, (image, caption) in enumerate(data_loader):
        image = image.to(device, non_blocking=True)
        loss = model(image, caption)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        loss_sum += loss.item()
        if i % 50 == 0:
            print(f"Caption Epoch [{epoch}] [{i}/{len(data_loader)}] loss {loss.item():.4f} "
                  f"lr {optimizer.param_groups[0]['lr']:.2e} ({time.time() - t0:.0f}s)")
    return {'loss': loss_sum / len(data_loader)}


@torch.no_grad()
def evaluate(model, data_loader, device):
    model.eval()
    result = []
    for image, image_id in data_loader:
        captions = model.generate(image.to(device))
        result += [{'image_id': int(i), 'caption': c} for i, c in zip(image_id, captions)]
    if get_world_size() > 1:
        gathered = [None] * get_world_size()
        dist.all_gather_object(gathered, result)
        result = [r for g in gathered for r in g]
    return list({r['image_id']: r for r in result}.values())


def coco_caption_eval(gt_file, results, out_file):
    json.dump(results, open(out_file, 'w'))
    coco = COCO(gt_file)
    coco_eval = COCOEvalCap(coco, coco.loadRes(out_file))
    coco_eval.evaluate()
    return coco_eval.eval


def cosine_lr_schedule(optimizer, epoch, max_epoch, init_lr, min_lr):
    lr = (init_lr - min_lr) * 0.5 * (1. + np.cos(np.pi * epoch / max_epoch)) + min_lr
    for param_group in optimizer.param_groups:
        param_group['lr'] = lr


def main(args):
    init_distributed_mode(args)
    device = torch.device('cuda')
    seed = args.seed + get_rank()
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)

    normalize = transforms.Normalize((0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711))
    transform_train = transforms.Compose([
        transforms.RandomResizedCrop(args.image_size, scale=(0.5, 1.0), interpolation=transforms.InterpolationMode.BICUBIC),
        transforms.RandomHorizontalFlip(), transforms.ToTensor(), normalize])
    transform_test = transforms.Compose([
        transforms.Resize((args.image_size, args.image_size), interpolation=transforms.InterpolationMode.BICUBIC),
        transforms.ToTensor(), normalize])
    train_dataset = CocoCaption(os.path.join(args.ann_root, 'coco_karpathy_train.json'), args.image_root, transform_train)
    val_dataset = CocoCaption(os.path.join(args.ann_root, 'coco_karpathy_val.json'), args.image_root, transform_test, train=False)
    test_dataset = CocoCaption(os.path.join(args.ann_root, 'coco_karpathy_test.json'), args.image_root, transform_test, train=False)

    if args.distributed:
        val_sampler, test_sampler = create_sampler([val_dataset, test_dataset], [False, False], get_world_size(), get_rank())
    else:
        val_sampler, test_sampler = None, None
    train_loader = DataLoader(train_dataset, batch_size=args.batch_size, shuffle=True, num_workers=4,
                              pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_dataset, batch_size=64, sampler=val_sampler, shuffle=False, num_workers=4)
    test_loader = DataLoader(test_dataset, batch_size=64, sampler=test_sampler, shuffle=False, num_workers=4)

    model = BLIPDecoder(vit=args.vit).to(device)
    if args.pretrained:
        checkpoint = torch.load(args.pretrained, map_location='cpu')
        print(model.load_state_dict(checkpoint['model'], strict=False))
    model_without_ddp = model
    if args.distributed:
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[args.gpu])
        model_without_ddp = model.module
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.init_lr, weight_decay=args.weight_decay)

    best, best_epoch = 0.0, 0
    for epoch in range(args.max_epoch):
        cosine_lr_schedule(optimizer, epoch, args.max_epoch, args.init_lr, 0)
        train_stats = train(model, train_loader, optimizer, epoch, device)
        val_result = evaluate(model_without_ddp, val_loader, device)
        test_result = evaluate(model_without_ddp, test_loader, device)
        if is_main_process():
            val_eval = coco_caption_eval(os.path.join(args.ann_root, 'coco_karpathy_val_gt.json'), val_result,
                                         os.path.join(args.result_dir, f'val_epoch{epoch}.json'))
            test_eval = coco_caption_eval(os.path.join(args.ann_root, 'coco_karpathy_test_gt.json'), test_result,
                                          os.path.join(args.result_dir, f'test_epoch{epoch}.json'))
            if val_eval['CIDEr'] + val_eval['Bleu_4'] > best:
                best, best_epoch = val_eval['CIDEr'] + val_eval['Bleu_4'], epoch
                torch.save({'model': model_without_ddp.state_dict(), 'optimizer': optimizer.state_dict(), 'epoch': epoch},
                           os.path.join(args.output_dir, 'checkpoint_best.pth'))
            log_stats = {**{f'train_{k}': v for k, v in train_stats.items()}, **{f'val_{k}': v for k, v in val_eval.items()},
                         **{f'test_{k}': v for k, v in test_eval.items()}, 'epoch': epoch, 'best_epoch': best_epoch}
            with open(os.path.join(args.output_dir, "log.txt"), "a") as f:
                f.write(json.dumps(log_stats) + "\n")
        if args.distributed:
            dist.barrier()
    if args.distributed:
        dist.destroy_process_group()


if __name__ == '__main__':
    parser = argparse.ArgumentParser()
    parser.add_argument('--image_root', default='/export/share/datasets/vision/coco/images/')
    parser.add_argument('--ann_root', default='annotation')
    parser.add_argument('--output_dir', default='output/Caption_coco')
    parser.add_argument('--pretrained', default='')
    parser.add_argument('--vit', default='vit_base_patch16_384')
    parser.add_argument('--image_size', default=384, type=int)
    parser.add_argument('--batch_size', default=32, type=int)
    parser.add_argument('--init_lr', default=1e-5, type=float)
    parser.add_argument('--weight_decay', default=0.05, type=float)
    parser.add_argument('--max_epoch', default=5, type=int)
    parser.add_argument('--seed', default=42, type=int)
    parser.add_argument('--dist_url', default='env://')
    args = parser.parse_args()
    args.result_dir = os.path.join(args.output_dir, 'result')
    Path(args.output_dir).mkdir(parents=True, exist_ok=True)
    Path(args.result_dir).mkdir(parents=True, exist_ok=True)
    start_time = time.time()
    main(args)
    print('Training time {}'.format(str(datetime.timedelta(seconds=int(time.time() - start_time)))))
