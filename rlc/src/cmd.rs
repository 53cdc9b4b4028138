//! The one-shot commands: the adapters between a command line and the layers below.

pub mod backtest;
pub mod demo;
pub mod preview;
pub mod run;
pub mod validate;
