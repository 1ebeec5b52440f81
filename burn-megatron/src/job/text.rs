//! Fields a job file keeps as their command-line text (`"full:2"`, `"fp8-delayed:16:max"`,
//! `"all-to-all"`): written as their [`Spec`], read back with `FromStr`, whose error becomes the
//! file's.

use std::str::FromStr;

use serde::de::Error;
use serde::{Deserialize, Deserializer, Serializer};

use crate::layers::context::ContextParallel;
use crate::layers::moe::ExpertParallel;
use crate::recompute::Recompute;
use burn_megatron_kernels::quant::recipe::Recipe;

/// A value's command-line text, which its `FromStr` reads back.
pub trait Spec {
    fn spec(&self) -> String;
}

impl Spec for Recompute {
    fn spec(&self) -> String {
        Recompute::spec(self)
    }
}

impl Spec for Recipe {
    fn spec(&self) -> String {
        Recipe::spec(*self)
    }
}

impl Spec for ContextParallel {
    fn spec(&self) -> String {
        self.name().into()
    }
}

impl Spec for ExpertParallel {
    fn spec(&self) -> String {
        self.name().into()
    }
}

pub fn serialize<T: Spec, S: Serializer>(value: &T, serializer: S) -> Result<S::Ok, S::Error> {
    serializer.serialize_str(&value.spec())
}

pub fn deserialize<'de, T, D>(deserializer: D) -> Result<T, D::Error>
where
    T: FromStr<Err = String>,
    D: Deserializer<'de>,
{
    String::deserialize(deserializer)?.parse().map_err(D::Error::custom)
}

/// An optional such field, `"default"` (or absent) for none.
pub mod optional {
    use super::*;

    pub fn serialize<T: Spec, S: Serializer>(value: &Option<T>, serializer: S) -> Result<S::Ok, S::Error> {
        match value {
            Some(value) => serializer.serialize_str(&value.spec()),
            None => serializer.serialize_str("default"),
        }
    }

    pub fn deserialize<'de, T, D>(deserializer: D) -> Result<Option<T>, D::Error>
    where
        T: FromStr<Err = String>,
        D: Deserializer<'de>,
    {
        match String::deserialize(deserializer)?.as_str() {
            "default" => Ok(None),
            text => text.parse().map(Some).map_err(D::Error::custom),
        }
    }
}
